"""``pretrain_gpt.py --dry-run --world-size N --rank R``: one rank of a layout at scale on
the meta device with a fake process group, in seconds (a subprocess: the fake group is
process-global)."""

from __future__ import annotations

import subprocess

import pytest

from megalite.arguments import parse_args
from megalite.planner.memory import stage_param_counts
from megalite.planner.dry_run import split_dry_run_flags
from tests.training.common import ENTRYPOINT, PYTHON, subprocess_env

GPT_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--vocab-size", "50257", "--tokenizer-type",
            "NullTokenizer", "--mock-data", "--global-batch-size", "1536",
            "--micro-batch-size", "1", "--train-iters", "1", "--bf16"]
LAYOUT = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
          "--sequence-parallel", "--use-distributed-optimizer"]


def _dry(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, ENTRYPOINT, "--dry-run", *flags], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)


@pytest.mark.parametrize("rank", [0, 1023])   # first stage (embedding), last (output)
def test_dry_run_1024_ranks_tp8_pp8_dp16(rank):
    out = _dry("--world-size", "1024", "--rank", str(rank), *GPT_175B, *LAYOUT)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = parse_args(GPT_175B + LAYOUT).validate(1024)
    cfg.model.vocab_size = 50258   # NullTokenizer's end-of-document token
    pp_rank = rank // 128
    expected = sum(stage_param_counts(cfg.model, cfg.parallel, pp_rank))
    assert f"parameters on this rank: {expected:,}" in out.stdout, out.stdout
    assert f"pp {pp_rank}/8" in out.stdout and "dp" in out.stdout
    assert "estimated peak memory" in out.stdout and "transfer rounds matched" in out.stdout


def test_dry_run_names_the_broken_rule():
    out = _dry("--world-size", "1000", "--rank", "3", *GPT_175B, *LAYOUT)
    assert out.returncode == 2
    assert "world size (1000) must be divisible" in out.stderr


def test_dry_run_flags():
    assert split_dry_run_flags(["--a", "1"]) == (["--a", "1"], None)
    assert split_dry_run_flags(["--dry-run", "--world-size=16", "--rank", "3", "--a"]) == (
        ["--a"], (16, 3))
    from megalite.config import ConfigError

    with pytest.raises(ConfigError, match="needs --world-size"):
        split_dry_run_flags(["--dry-run"])


DEEPSEEK_V3_ATTENTION = [
    "--num-layers", "4", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "128", "--seq-length", "4096", "--vocab-size", "129280",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "64",
    "--micro-batch-size", "1", "--train-iters", "1", "--bf16", "--normalization", "RMSNorm",
    "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--qk-layernorm",
    "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--rotary-scaling-factor", "40",
    "--mscale", "1.0", "--mscale-all-dim", "1.0", "--recompute-granularity", "selective",
    "--recompute-modules", "mla_up_proj", "core_attn"]


@pytest.mark.parametrize("rank", [0, 63])
def test_dry_run_deepseek_v3_attention_tp8_pp2(rank):
    """DeepSeek-V3's attention at its real sizes on one rank of tp 8 x pp 2 x dp 4: the
    built rank holds what the planner counts (replicated down projections, 1/8 of the up
    projections)."""
    layout = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
              "--sequence-parallel", "--use-distributed-optimizer"]
    out = _dry("--world-size", "64", "--rank", str(rank), *DEEPSEEK_V3_ATTENTION, *layout)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = parse_args(DEEPSEEK_V3_ATTENTION + layout).validate(64)
    cfg.model.vocab_size = 129281
    expected = sum(stage_param_counts(cfg.model, cfg.parallel, rank // 32))
    assert f"parameters on this rank: {expected:,}" in out.stdout, out.stdout


def test_dry_run_deepseek_v3_multi_token_prediction_on_the_last_stage():
    """One prediction depth (an MLA layer, untied output): the last stage of tp 8 x pp 2
    holds the depth and a copy of the word embedding, as the planner counts them."""
    layout = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
              "--sequence-parallel", "--use-distributed-optimizer", "--mtp-num-layers", "1"]
    out = _dry("--world-size", "64", "--rank", "63", *DEEPSEEK_V3_ATTENTION, *layout)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = parse_args(DEEPSEEK_V3_ATTENTION + layout).validate(64)
    cfg.model.vocab_size = 129281
    expected = sum(stage_param_counts(cfg.model, cfg.parallel, 1))
    cfg.model.mtp_num_layers = None
    assert expected > sum(stage_param_counts(cfg.model, cfg.parallel, 1))
    assert f"parameters on this rank: {expected:,}" in out.stdout, out.stdout


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_dry_run_multi_token_prediction_under_a_v_schedule(schedule):
    """Under a V schedule the depth sits on pipeline rank 0 (chunk 1, after the last
    layers), beside the embedding and its own copy of it: rank 0's parameters are what the
    planner counts for the output stage, and the last rank holds no depth."""
    layout = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2",
              "--pipeline-schedule", schedule, "--sequence-parallel",
              "--use-distributed-optimizer", "--mtp-num-layers", "1"]
    cfg = parse_args(DEEPSEEK_V3_ATTENTION + layout).validate(64)
    cfg.model.vocab_size = 129281
    for rank, stage in ((0, 0), (63, 1)):
        out = _dry("--world-size", "64", "--rank", str(rank), *DEEPSEEK_V3_ATTENTION, *layout)
        assert out.returncode == 0, out.stderr[-2000:]
        expected = sum(stage_param_counts(cfg.model, cfg.parallel, stage))
        assert f"parameters on this rank: {expected:,}" in out.stdout, out.stdout
    with_depth = sum(stage_param_counts(cfg.model, cfg.parallel, 0))
    cfg.model.mtp_num_layers = None
    assert with_depth > sum(stage_param_counts(cfg.model, cfg.parallel, 0))


MIXTRAL_MOE = ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
               "--num-attention-heads", "32", "--group-query-attention",
               "--num-query-groups", "8", "--seq-length", "4096", "--vocab-size", "32000",
               "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size",
               "64", "--micro-batch-size", "1", "--train-iters", "1", "--bf16",
               "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
               "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
               "--num-experts", "8", "--moe-router-topk", "2"]


MIXTRAL_TP2_EP4 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"]
GPT_LEARNED = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
               "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size",
               "1000", "--tokenizer-type", "NullTokenizer", "--mock-data",
               "--global-batch-size", "32", "--micro-batch-size", "1", "--train-iters", "1"]


@pytest.mark.parametrize("model,layout,rank,optimizer", [
    (DEEPSEEK_V3_ATTENTION, ["--tensor-model-parallel-size", "8",
                             "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                             "--mtp-num-layers", "1"], 63, "muon"),
    (MIXTRAL_MOE, [*MIXTRAL_TP2_EP4, "--muon-no-split-qkv"], 5, "muon"),
    (MIXTRAL_MOE, MIXTRAL_TP2_EP4, 5, "lion"),
    (GPT_LEARNED, ["--tensor-model-parallel-size", "2"], 0, "lion"),
], ids=["deepseek-v3-attention-mtp", "mixtral-tp2-ep4", "mixtral-tp2-ep4-lion",
        "gpt-learned-positions-lion"])
def test_dry_run_muon_matrices_are_the_planners(model, layout, rank, optimizer):
    """Under --optimizer muon the dry run checks the built rank's Muon matrices (their
    dense and expert elements: tp shards, replicated down projections, local experts over
    etp, the prediction depth) against the planner's count from the config; under
    --optimizer lion its linear weights (the routers and a learned position embedding
    too)."""
    out = _dry("--world-size", "64", "--rank", str(rank), *model, *layout,
               "--optimizer", optimizer, "--use-distributed-optimizer")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "parameters on this rank" in out.stdout
