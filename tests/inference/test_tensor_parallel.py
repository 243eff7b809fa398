"""Tensor-parallel generation: a checkpoint saved at tp=1 loads at tp=2 (resharded), the
two ranks' KV caches hold their own heads, and greedy tokens equal tp=1's token for
token, logits within fp32 rounding; batches too. Other layouts are refused in one line."""

import argparse

import pytest
import torch

from megalite.checkpoint.consolidated import save_full_model
from megalite.config import ConfigError, MegaliteConfig
from megalite.inference.generation import generate, generate_batch, sequence_logits
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.loading import (
    check_inference_layout,
    inference_state,
    load_model,
)
from megalite.models.gpt import GPTModel
from tests.distributed.harness import run_distributed
from tests.model.common import gpt2_config, llama_config, mixtral_config, single_process_state
from tests.model.test_hf_parity import _random_weights

PROMPTS = [[3, 17, 41, 8, 29], [9], [22, 4, 31, 40, 2, 11, 6, 1, 30]]
TOKENS = [5, 12, 44, 0, 7, 33, 21, 19, 48, 2, 10, 27]
CONFIGS = {"llama": llama_config, "gpt2": gpt2_config, "mixtral": mixtral_config}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: checkpoint directory} of random-weight models saved at tp=1 (vocab 50,
    padded to 56 at tp=1 and 64 at tp=2)."""
    out = {}
    for family, make in CONFIGS.items():
        cfg = MegaliteConfig(model=make())
        model = GPTModel(cfg.model, single_process_state(), seed=1)
        root = str(tmp_path_factory.mktemp(family))
        save_full_model(cfg, _random_weights(model), root)
        out[family] = root
    return out


def _run(root: str, tp: int):
    ps = inference_state(tp)
    _, model = load_model(root, None, ps)
    torch.manual_seed(0)
    cache = InferenceCache(len(TOKENS))
    with torch.no_grad():
        model(torch.tensor([TOKENS[:4]]), inference_cache=cache)
    heads = cache.layer(1).k.shape[2]  # this rank's query groups, [max_len, b, ng/tp, d]
    return {
        "greedy": [generate(model, p, 10) for p in PROMPTS],
        "batch": generate_batch(model, PROMPTS, 10),
        "logits": sequence_logits(model, TOKENS, use_cache=True),
        "full": sequence_logits(model, TOKENS, use_cache=False),
        "cached_groups": heads,
        "padded_vocab": model.output_weight().shape[0] * tp,
    }


def _on_rank(rank, world_size, root):
    return _run(root, world_size)


def _refused(rank, world_size, root):
    try:
        load_model(root, None, inference_state(world_size))
    except ConfigError as exc:
        return str(exc)
    return None


def test_moe_at_tp2_is_refused(saved):
    for message in run_distributed(2, _refused, saved["mixtral"]):
        assert message.startswith("--tensor-model-parallel-size 2: MoE models (4 experts) "
                                  "run inference at tensor parallel size 1"), message


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp2_generation_equals_tp1(saved, family):
    one = _run(saved[family], 1)
    two = run_distributed(2, _on_rank, saved[family])
    groups = CONFIGS[family]().num_query_groups or CONFIGS[family]().num_attention_heads
    assert one["cached_groups"] == groups
    assert one["padded_vocab"] == 56
    for rank in two:
        assert rank["cached_groups"] == groups // 2 and rank["padded_vocab"] == 64
        assert rank["greedy"] == one["greedy"]
        assert rank["batch"] == one["greedy"]
        assert rank["logits"].shape == one["logits"].shape == (len(TOKENS), 50)
        assert (rank["logits"] - one["logits"]).abs().max().item() < 1e-4
        assert (rank["full"] - one["logits"]).abs().max().item() < 1e-4
    assert len({tuple(map(tuple, r["greedy"])) for r in two}) == 1
    assert any(len(set(g)) > 1 for g in one["greedy"])  # not a constant output


@pytest.mark.parametrize("flags, message", [
    ({"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2: inference "
                                          "runs tensor parallel only"),
    ({"context_parallel_size": 2}, "--context-parallel-size 2"),
    ({"sequence_parallel": True}, "--sequence-parallel"),
])
def test_other_layouts_refused(flags, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        check_inference_layout(argparse.Namespace(**flags))
    with pytest.raises(ConfigError, match="needs 2 processes, this run has 1"):
        inference_state(2)  # plain python: no torchrun world
