"""Pipeline-parallel generation: a checkpoint saved at tp1 pp1 loads at pp 2 (and tp 2 x
pp 2) with each stage holding its layers and their part of the KV cache; greedy tokens
equal one process's token for token, logits within fp32 rounding, on every rank (the last
stage's tokens are broadcast). A pp that does not divide the layers is refused."""

import pytest

from megalite.config import ConfigError
from tests.distributed.harness import run_distributed
from tests.inference.common import check_equal, on_rank, run_layout


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_pp2_generation_equals_one_process(saved, reference, family):
    ranks = run_distributed(2, on_rank, saved[family], 1, 2)
    check_equal(reference[family], ranks, family, 1)
    assert [r["stage_layers"] for r in ranks] == [[0], [1]]
    assert ranks[0]["padded_vocab"] is None and ranks[1]["padded_vocab"] == 56


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_tp2_pp2_generation_equals_one_process(saved, reference, family):
    ranks = run_distributed(4, on_rank, saved[family], 2, 2)
    check_equal(reference[family], ranks, family, 2)
    # world ranks are tp-fastest: ranks 0, 1 are stage 0's two tp ranks
    assert [r["stage_layers"] for r in ranks] == [[0], [0], [1], [1]]


def _refused(rank, world_size, root, tp, pp):
    try:
        run_layout(root, tp, pp)
    except ConfigError as exc:
        return str(exc)
    return None


def test_pp_that_does_not_divide_the_layers(saved):
    """3 stages for the 2 layers of the tiny models."""
    for message in run_distributed(3, _refused, saved["llama"], 1, 3):
        assert message == ("--pipeline-model-parallel-size 3 does not divide the model's "
                           "2 layers; choose a divisor"), message


def test_pp2_follows_the_checkpoints_uneven_stages(tmp_path):
    """A 3-layer model trained at pp 2 with --decoder-first-pipeline-num-layers 1 loads at
    pp 2 split as it trained (stage 0 one layer, stage 1 two) and generates one process's
    tokens; at another pp the layers split evenly (or are refused when they do not)."""
    from megalite.checkpoint.consolidated import save_full_model
    from megalite.config import MegaliteConfig, ParallelConfig
    from megalite.models.gpt import GPTModel
    from tests.inference.common import CONFIGS
    from tests.model.common import single_process_state
    from tests.model.test_hf_parity import _random_weights

    cfg = MegaliteConfig(model=CONFIGS["llama"](num_layers=3),
                         parallel=ParallelConfig(pipeline_model_parallel_size=2,
                                                 decoder_first_pipeline_num_layers=1))
    model = GPTModel(cfg.model, single_process_state(), seed=1)
    root = str(tmp_path / "uneven")
    save_full_model(cfg, _random_weights(model), root)
    one = run_layout(root)
    ranks = run_distributed(2, on_rank, root, 1, 2)
    assert [r["stage_layers"] for r in ranks] == [[0], [1, 2]]
    for rank in ranks:
        assert rank["greedy"] == one["greedy"] and rank["batch"] == one["greedy"]
        assert (rank["logits"] - one["logits"]).abs().max().item() < 1e-4
    for message in run_distributed(3, _refused, root, 1, 3):     # 3 stages: one layer each
        assert message is None, message
