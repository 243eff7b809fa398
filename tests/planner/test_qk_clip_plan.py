"""The planner under ``--qk-clip``: the largest-logit pass over the attention scores
(:mod:`megalite.transformer.max_logits`) adds ``2 nh d_qk s^2`` fp32 FLOPs per sequence and
layer forward (twice under full recomputation), its score traffic, under cp the keys'
all-gather per layer forward, and its working set to the transient memory."""

from __future__ import annotations

import pytest

from megalite.arguments import parse_args
from megalite.planner import qk_clip
from megalite.planner.cluster import preset
from megalite.planner.memory import estimate_memory
from megalite.planner.time import estimate_time

BASE = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
        "--group-query-attention", "--num-query-groups", "2", "--seq-length", "4096",
        "--max-position-embeddings", "4096", "--vocab-size", "32000",
        "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
        "--tokenizer-type", "NullTokenizer", "--mock-data"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]


def _cfg(*extra, world=8):
    return parse_args(BASE + list(extra)).validate(world)


def test_flops_are_one_fp32_qk_product_per_layer_forward():
    s, nh, d, layers = 4096, 8, 64, 4
    per_sequence = 2 * nh * d * s * s * layers
    assert qk_clip.flops_per_sequence(_cfg("--qk-clip").model) == per_sequence
    assert qk_clip.flops_per_sequence(_cfg("--log-max-attention-logit").model) == per_sequence
    assert qk_clip.flops_per_sequence(_cfg().model) == 0.0
    # full recomputation re-runs the layer's forward, and with it the pass
    assert qk_clip.flops_per_sequence(_cfg("--qk-clip", *FULL).model) == 2 * per_sequence
    # multi-latent attention: every head has its keys, d_qk = qk_head_dim + rope dim
    gqa = BASE.index("--group-query-attention")
    mla_flags = BASE[:gqa] + BASE[gqa + 3:] + [
        "--qk-clip", "--multi-latent-attention", "--kv-lora-rank", "64", "--qk-head-dim",
        "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32",
        "--position-embedding-type", "rope"]
    mla = parse_args(mla_flags).validate(8).model
    assert qk_clip.flops_per_sequence(mla) == 2 * nh * (32 + 16) * s * s * layers
    assert qk_clip.key_heads(mla) == nh
    # its up projections and kernel recomputed together: one checkpoint around the pass
    both = parse_args(mla_flags + ["--recompute-granularity", "selective",
                                   "--recompute-modules", "mla_up_proj", "core_attn"]
                      ).validate(8).model
    assert qk_clip.flops_per_sequence(both) == 2 * 2 * nh * (32 + 16) * s * s * layers
    core = parse_args(mla_flags + ["--recompute-granularity", "selective",
                                   "--recompute-modules", "core_attn"]).validate(8).model
    assert qk_clip.flops_per_sequence(core) == 2 * nh * (32 + 16) * s * s * layers


def test_qk_clip_adds_its_pass_to_the_predicted_time():
    cluster = preset("h100", 1)
    plain, clipped = (estimate_time(_cfg(*f, "--tensor-model-parallel-size", "2"), 8,
                                    cluster) for f in ([], ["--qk-clip"]))
    s, nh, d, layers, gbs, world = 4096, 8, 64, 4, 16, 8
    flops = 2 * nh * d * s * s * layers * gbs / world
    traffic = 6 * 4 * nh * s * s * layers * gbs / world
    want = flops / (67e12 * 0.7) + traffic / (3.35e12 * cluster.memory_efficiency)
    assert clipped.compute - plain.compute == pytest.approx(want, rel=1e-9)
    assert clipped.step > plain.step
    assert clipped.model_flops == plain.model_flops     # not model FLOPs: MFU drops
    # the once-per-step maxima reduction over dp x cp and the world's top value
    assert clipped.calls["dp"] == plain.calls["dp"] + 2


def test_context_parallel_gathers_the_keys_per_layer_forward():
    cluster = preset("h100", 1)
    flags = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    plain, clipped = (estimate_time(_cfg(*flags, *f), 8, cluster)
                      for f in ([], ["--qk-clip"]))
    # per layer and micro-batch: (cp - 1) chunks of [s/cp, b, ng/tp, d] bf16
    chunk = 4096 // 2 * 1 * (2 // 2) * 64 * 2
    micro = 16 // (1 * 2)                           # dp 2
    assert clipped.comm_bytes["cp"] - plain.comm_bytes["cp"] == 4 * micro * chunk
    assert clipped.comm["cp"] > plain.comm["cp"]
    full = [estimate_time(_cfg(*flags, *FULL, *f), 8, cluster) for f in ([], ["--qk-clip"])]
    assert full[1].comm_bytes["cp"] - full[0].comm_bytes["cp"] == 2 * 4 * micro * chunk


def test_the_pass_keeps_nothing_and_its_working_set_is_transient():
    m = _cfg("--qk-clip").model
    # one row of [b, nh, 1, s] scores is 32 K floats: 128 rows per chunk of 4 M
    rows = (1 << 22) // (8 * 4096)
    want = 2 * rows * 8 * 4096 * 4 + (4096 * 8 + 4096 * 2) * 64 * 4
    assert qk_clip.transient_bytes(m, 1, 1, 1, 2) == want
    # cp 2: half the queries, all keys, and the gathered keys in bf16
    want_cp = 2 * rows * 8 * 4096 * 4 + (2048 * 8 + 4096 * 2) * 64 * 4 + 4096 * 2 * 64 * 2
    assert qk_clip.transient_bytes(m, 1, 2, 1, 2) == want_cp
    plain, clipped = (estimate_memory(_cfg(*f, "--seq-length", "32768",
                                           "--max-position-embeddings", "32768"), 8)
                      for f in ([], ["--qk-clip"]))
    assert clipped.activations == plain.activations
    assert clipped.transient >= plain.transient


def test_the_fp32_rate_comes_from_the_preset_or_the_flag():
    from tests.tools import load_tool

    tool = load_tool("plan_layout")
    parse = tool._parser().parse_args
    assert tool.build_cluster(parse(["--preset", "a100"])).fp32_flops == 19.5e12
    assert tool.build_cluster(parse(["--preset", "h100", "--peak-fp32-tflops", "60"])
                              ).fp32_flops == 60e12
