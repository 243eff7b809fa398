"""Tensor-parallel generation: a checkpoint saved at tp=1 loads at tp=2 (resharded), the
two ranks' KV caches hold their own heads, and greedy tokens equal tp=1's token for
token, logits within fp32 rounding; batches too; Mixtral (MoE) at tp 2 too (a decoding
step's one token is padded to tp inside the MoE layer). Other layouts and bad sizes are
refused in one line."""

import argparse

import pytest

from megalite.config import ConfigError
from megalite.inference.loading import check_inference_layout, inference_state
from tests.distributed.harness import run_distributed
from tests.inference.common import check_equal, on_rank


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_tp2_generation_equals_tp1(saved, reference, family):
    two = run_distributed(2, on_rank, saved[family], 2)
    check_equal(reference[family], two, family, 2)
    assert [r["stage_layers"] for r in two] == [[0, 1], [0, 1]]


def test_mixtral_tp2_etp1_generation_equals_tp1(saved, reference):
    """The experts whole on each tp rank (--expert-tensor-parallel-size 1): each rank
    routes and computes its share of the tokens (a decoding step's padded to tp)."""
    two = run_distributed(2, on_rank, saved["mixtral"], 2, 1, 1, 1)
    check_equal(reference["mixtral"], two, "mixtral", 2)


def test_mixtral_tp2_ep2_generation_equals_tp1(saved, reference):
    """Half the experts on each rank (--expert-model-parallel-size 2, etp 1): tokens go
    to their experts' rank and back (all-to-all over ep), and a decoding step often sends
    a rank no token at all."""
    two = run_distributed(2, on_rank, saved["mixtral"], 2, 1, 2, 1)
    check_equal(reference["mixtral"], two, "mixtral", 2)


@pytest.mark.parametrize("flags, message", [
    ({"context_parallel_size": 2}, "--context-parallel-size 2: inference runs tensor, "
                                   "pipeline and expert parallel"),
    ({"sequence_parallel": True}, "--sequence-parallel"),
    ({"pipeline_model_parallel_size": 0}, "--pipeline-model-parallel-size must be >= 1, "
                                          "got 0"),
])
def test_other_layouts_refused(flags, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        check_inference_layout(argparse.Namespace(**flags))


def test_world_size_and_expert_sizes_refused():
    with pytest.raises(ConfigError, match="needs 2 processes, this run has 1"):
        inference_state(2)  # plain python: no torchrun world
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 x "
                                          r"--pipeline-model-parallel-size 2 needs 4 "
                                          r"processes, this run has 1"):
        inference_state(2, 2)
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 1 x "
                                          r"--expert-tensor-parallel-size 4 must divide "
                                          r"--tensor-model-parallel-size 2"):
        inference_state(2, 1, 1, 4)
