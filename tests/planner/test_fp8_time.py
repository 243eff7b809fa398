"""The fp8 step-time terms beyond the GEMMs' FLOPs (:mod:`megalite.planner.fp8_time`): the
quantisation traffic of the fp8 linears' inputs, output gradients and weights at memory
bandwidth, and the GEMMs megalite emulates in fp32 (mxfp8 everywhere, blockwise without
the block-scaled kernel or with e5m2 gradients), each checked against numbers worked out
here by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.arguments import parse_args
from megalite.config import ModelConfig
from megalite.config.layout import resolve_layout
from megalite.planner.cluster import preset
from megalite.planner.fp8_memory import fp8_linear_weights
from megalite.planner.fp8_time import (
    activation_quantize_bytes,
    emulated_gemms,
    fp8_gemm_flops_per_token,
    fp8_linear_gemms,
    gemm_seconds,
    weight_quantize_bytes,
)
from megalite.planner.time import StepContext, estimate_time
from tests.planner.test_fp8_plan import LLAMA
from tests.tools import load_tool

# two dense layers, h 64, 4 heads of 16 (no GQA), ffn 128, no swiglu: per layer qkv
# K 64 N 192, proj K 64 N 64, fc1 K 64 N 128, fc2 K 128 N 64
SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
             ffn_hidden_size=128, fp8_format="hybrid")
X, DY = 64 + 64 + 64 + 128, 192 + 64 + 128 + 64       # K and N summed over the linears
TOKENS = 32


def _small(**kw):
    return ModelConfig(**{**SMALL, **kw})


@pytest.mark.parametrize("recipe, extra, per_x, per_dy", [
    # tensorwise: reads 2 x 2 bytes (amax, cast); x writes qx (qx_t: the memory-bound
    # term's), dy writes qg and qg_t
    ("tensorwise", {}, 4 + 1, 4 + 2),
    # delayed: the cast's read alone
    ("delayed", {}, 2 + 1, 2 + 2),
    # --no-fp8-wgrad: no transposed copies (and x saved in bf16)
    ("tensorwise", {"fp8_wgrad": False}, 4 + 1, 4 + 1),
    ("delayed", {"fp8_wgrad": False}, 2 + 1, 2 + 1),
    # block recipes: each operand twice (along each contraction), read 2, written 1 and a
    # 32nd (an e8m0 byte per 32, an fp32 per 128)
    ("mxfp8", {}, 2 * (2 + 1 + 1 / 32), 2 * (2 + 1 + 1 / 32)),
    ("blockwise", {}, 2 * (2 + 1 + 1 / 32), 2 * (2 + 1 + 1 / 32)),
    ("blockwise", {"fp8_wgrad": False}, 2 + 1 + 1 / 32, 2 + 1 + 1 / 32),
])
def test_quantisation_bytes_per_micro_batch(recipe, extra, per_x, per_dy):
    m = _small(fp8_recipe=recipe, **extra)
    expected = 2 * TOKENS * (per_x * X + per_dy * DY)
    assert activation_quantize_bytes(m, 1, TOKENS, 2) == pytest.approx(expected, rel=1e-12)


def test_quantisation_bytes_order_and_recomputation():
    def count(recipe, forwards=1, **kw):
        return activation_quantize_bytes(_small(fp8_recipe=recipe, **kw), 1, TOKENS, 2,
                                         forwards)

    assert count("tensorwise") == 2 * 32 * (5 * 320 + 6 * 448) == 274432
    assert count("delayed") == 2 * 32 * (3 * 320 + 4 * 448) == 176128
    assert count("tensorwise", fp8_wgrad=False) == 2 * 32 * (5 * 320 + 5 * 448) == 245760
    assert count("tensorwise") > count("tensorwise", fp8_wgrad=False) > count("delayed")
    # full recomputation quantises x again, qx_t included (the memory-bound term counts
    # one qx_t): x 2 x (4 + 2) - 1
    assert count("tensorwise", 2) == 2 * 32 * (11 * 320 + 6 * 448)
    # block: x once more along K, not along M again
    assert count("mxfp8", 2) == pytest.approx(2 * 32 * (3 * 320 + 2 * 448) * (3 + 1 / 32))
    assert count("tensorwise", fp8_format=None) == 0.0
    # the first and last layers kept in bf16: none left
    assert count("tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                 num_layers_at_end_in_bf16=1) == 0.0


def test_quantisation_bytes_split_over_tensor_parallel_ranks():
    m = _small(fp8_recipe="tensorwise", num_query_groups=2, group_query_attention=True)
    # tp 2: qkv K 64 N (4 + 4) 16 / 2 = 64, proj K 32 N 64, fc1 K 64 N 64, fc2 K 64 N 64
    expected = 2 * TOKENS * (5 * (64 + 32 + 64 + 64) + 6 * (64 + 64 + 64 + 64))
    assert activation_quantize_bytes(m, 2, TOKENS, 2) == expected


@pytest.mark.parametrize("kw", [
    dict(SMALL),
    dict(SMALL, swiglu=True, group_query_attention=True, num_query_groups=2),
    dict(SMALL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
         moe_shared_expert_intermediate_size=48, swiglu=True, moe_layer_freq="[0]+[1]"),
    dict(SMALL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32),
    dict(SMALL, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32,
         qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
    dict(SMALL, multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16,
         qk_pos_emb_head_dim=8, v_head_dim=16),
])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_quantised_linears_are_those_of_the_fp8_weights(kw, tp):
    """The linears whose operands are quantised are those whose weights the fp8 GEMM
    FLOPs and memory count: attention's (MLA: up and output projections), the dense MLP
    or the shared expert, not the routed experts."""
    m = ModelConfig(**kw)
    for layer in range(m.num_layers):
        gemms = fp8_linear_gemms(m, layer, TOKENS, tp)
        assert all(mm == TOKENS for mm, _, _ in gemms)
        assert tp * sum(k * n for _, k, n in gemms) == fp8_linear_weights(m, layer)


@pytest.mark.parametrize("recipe, kw, per_weight", [
    # amax (2), cast (2 + 1), transposed copy (1 + 1)
    ("tensorwise", {}, 4 + 1 + 2),
    # cast (2 + 1), transposed copy (2), the amax read again at the 3 later forwards
    ("delayed", {}, 2 + 1 + 2 + 3 * 2),
    # along K and the transpose along N, each read 2, written 1 + 1/32
    ("blockwise", {}, 2 * (3 + 1 / 32)),
    ("mxfp8", {}, 2 * (3 + 1 / 32)),
    # ZeRO-3: a cast per pass and micro-batch (8), a transposed copy per backward (4)
    ("tensorwise", {"zero3": True}, 8 * (4 + 1) + 4 * 2),
    ("delayed", {"zero3": True}, 8 * (2 + 1) + 4 * 2),
    ("blockwise", {"zero3": True}, 8 * (3 + 1 / 32)),
    # --fp8-param-gather over 4 shards: the owner casts its quarter, once
    ("tensorwise", {"shards": 4, "gather": True}, (4 + 1) / 4 + 2),
    ("delayed", {"shards": 4, "gather": True}, (2 + 1) / 4 + 2),
    ("tensorwise", {"zero3": True, "shards": 4, "gather": True}, (4 + 1) / 4 + 4 * 2),
])
def test_weight_bytes_per_step(recipe, kw, per_weight):
    kw = dict(kw)
    m = _small(fp8_recipe=recipe, fp8_param_gather=kw.pop("gather", False))
    got = weight_quantize_bytes(m, 1000, 2, microbatches=4, passes=2, **kw)
    assert got == pytest.approx(1000 * per_weight, rel=1e-12)


def test_weight_bytes_under_full_recomputation():
    # 3 passes: delayed reads the amax again at 2 x 4 - 1 forwards; ZeRO-3 casts 12 times
    m = _small(fp8_recipe="delayed")
    assert weight_quantize_bytes(m, 10, 2, 4, passes=3) == 10 * (3 + 2 + 7 * 2)
    m = _small(fp8_recipe="tensorwise")
    assert weight_quantize_bytes(m, 10, 2, 4, passes=3, zero3=True) == 10 * (12 * 5 + 4 * 2)
    assert weight_quantize_bytes(_small(fp8_format=None), 10, 2, 4) == 0.0


H100 = preset("h100")
NO_KERNEL = replace(H100, fp8_block_kernel=False, name="no block kernel")


@pytest.mark.parametrize("recipe, fmt, cluster, emulated", [
    ("tensorwise", "hybrid", preset("h100"), set()),
    ("delayed", "e4m3", preset("a100"), set()),
    ("mxfp8", "e4m3", preset("h100"), {"fprop", "dgrad", "wgrad"}),
    ("mxfp8", "hybrid", preset("h200"), {"fprop", "dgrad", "wgrad"}),
    ("blockwise", "e4m3", preset("h100"), set()),
    ("blockwise", "e4m3", preset("h800"), set()),
    ("blockwise", "hybrid", preset("h200"), {"dgrad", "wgrad"}),
    ("blockwise", "e4m3", NO_KERNEL, {"fprop", "dgrad", "wgrad"}),
    ("blockwise", "hybrid", preset("a100"), {"fprop", "dgrad", "wgrad"}),
])
def test_emulated_gemms(recipe, fmt, cluster, emulated):
    assert emulated_gemms(_small(fp8_recipe=recipe, fp8_format=fmt), cluster) == emulated


def test_the_block_kernel_is_hoppers():
    assert [preset(n).fp8_block_kernel for n in ("h100", "h800", "h200", "a100")] == \
        [True, True, True, False]
    tool = load_tool("plan_layout")
    parse = tool._parser().parse_args
    assert tool.build_cluster(parse(["--preset", "h100"])).fp8_block_kernel
    assert not tool.build_cluster(parse(["--preset", "h100", "--no-fp8-block-kernel"])
                                  ).fp8_block_kernel
    assert tool.build_cluster(parse(["--preset", "a100", "--fp8-block-kernel"])
                              ).fp8_block_kernel
    assert not tool.build_cluster(parse(["--preset", "a100"])).fp8_block_kernel


def _ctx(cluster, *extra):
    cfg = parse_args(LLAMA + list(extra))
    cfg.validate(8)
    return StepContext(cfg, resolve_layout(cfg, 8), cluster)


# the LLAMA config: 8 layers of qkv 1024 x 1536, proj 1024 x 1024, fc1 1024 x 5632,
# fc2 2816 x 1024 weights; one GEMM kind, 2 FLOPs per weight over 64 x 2048 tokens,
# over 8 ranks at 0.7
WEIGHTS = 8 * (1024 * 1536 + 1024 * 1024 + 1024 * 5632 + 2816 * 1024)
ONE = 2.0 * WEIGHTS * 64 * 2048 / 8 / 0.7
FP8, FP32 = 1979e12, 67e12


@pytest.mark.parametrize("recipe, fmt, cluster, seconds", [
    ("tensorwise", "hybrid", preset("h100"), 3 * ONE / FP8),
    ("mxfp8", "e4m3", preset("h100"), 3 * ONE / FP32),
    ("blockwise", "hybrid", preset("h100"), ONE / FP8 + 2 * ONE / FP32),
    ("blockwise", "e4m3", preset("h100"), 3 * ONE / FP8),
    ("blockwise", "e4m3", NO_KERNEL, 3 * ONE / FP32),
    # no fp32 rate given: the bf16 peak
    ("mxfp8", "e4m3", replace(NO_KERNEL, fp32_flops=0.0), 3 * ONE / 989e12),
])
def test_fp8_gemm_seconds(recipe, fmt, cluster, seconds):
    ctx = _ctx(cluster, "--fp8-format", fmt, "--fp8-recipe", recipe)
    flops, got = gemm_seconds(ctx)
    assert flops == 3 * 2.0 * WEIGHTS * 64 * 2048
    assert got == pytest.approx(seconds, rel=1e-12)


def test_no_fp8_wgrad_runs_the_weight_gradient_at_the_bf16_rate():
    m = _ctx(preset("h100"), "--fp8-format", "hybrid", "--no-fp8-wgrad").cfg.model
    assert fp8_gemm_flops_per_token(m) == 4.0 * WEIGHTS
    ctx = _ctx(preset("h100"), "--fp8-format", "hybrid", "--fp8-recipe", "blockwise",
               "--no-fp8-wgrad")
    flops, got = gemm_seconds(ctx)    # fprop in fp8, dgrad (e5m2) emulated
    assert flops == 2 * 2.0 * WEIGHTS * 64 * 2048
    assert got == pytest.approx(ONE / FP8 + ONE / FP32, rel=1e-12)


def test_full_recomputation_runs_the_forward_again_in_fp8():
    ctx = _ctx(preset("h100"), "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
               "--recompute-granularity", "full", "--recompute-method", "uniform",
               "--recompute-num-layers", "1")
    flops, got = gemm_seconds(ctx)
    assert flops == 4 * 2.0 * WEIGHTS * 64 * 2048
    assert got == pytest.approx(4 * ONE / FP32, rel=1e-12)


def test_emulated_gemms_in_the_step_time():
    """The block recipes quantise alike, so their compute terms differ by the GEMMs'
    rates alone: mxfp8 emulates all three, blockwise hybrid the two gradient GEMMs."""
    def compute(recipe, fmt, cluster=H100):
        cfg = parse_args(LLAMA + ["--fp8-format", fmt, "--fp8-recipe", recipe])
        cfg.validate(8)
        return estimate_time(cfg, 8, cluster).compute

    base = compute("blockwise", "e4m3")
    slower = 1 / FP32 - 1 / FP8
    assert compute("mxfp8", "e4m3") - base == pytest.approx(3 * ONE * slower, rel=1e-9)
    assert compute("blockwise", "hybrid") - base == pytest.approx(2 * ONE * slower, rel=1e-9)
    assert compute("blockwise", "e4m3", NO_KERNEL) - base == pytest.approx(3 * ONE * slower,
                                                                           rel=1e-9)
