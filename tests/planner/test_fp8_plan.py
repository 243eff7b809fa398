"""The planner under ``--fp8-format``: the GEMMs megalite runs in fp8 (the layers'
tensor-parallel linears, not the routed experts, the output layer or the attention core;
not the layers ``--first-last-layers-bf16`` keeps) are timed at the GPU's fp8 rate, the
rest at its bf16 rate, and a GPU without fp8 GEMMs is refused."""

from __future__ import annotations

import pytest

from megalite.arguments import parse_args
from megalite.config import ModelConfig, shapes
from megalite.layers.fp8 import Fp8Recipe
from megalite.planner.cluster import preset
from megalite.planner.fp8_time import fp8_gemm_flops_per_token
from megalite.planner.time import estimate_time
from tests.tools import load_tool

LLAMA = ["--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
         "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--vocab-size", "32000", "--seq-length", "2048", "--max-position-embeddings", "2048",
         "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--mock-data",
         "--tokenizer-type", "NullTokenizer"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def _config(*extra):
    cfg = parse_args(LLAMA + list(extra))
    cfg.validate(8)
    return cfg


def test_fp8_flops_are_the_layers_linear_weights():
    m = _config(*FP8).model
    h, f, d = 1024, 2816, 64
    per_layer = h * (16 + 2 * 4) * d + 16 * d * h + 3 * h * f     # qkv, proj, fc1 (x2), fc2
    assert fp8_gemm_flops_per_token(m) == 6.0 * 8 * per_layer
    assert fp8_gemm_flops_per_token(_config().model) == 0.0
    edges = _config(*FP8, "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                    "--num-layers-at-end-in-bf16", "1").model
    assert fp8_gemm_flops_per_token(edges) == 6.0 * 5 * per_layer
    # the rule the model's layers use
    assert [Fp8Recipe.for_layer(edges, i) is not None for i in range(8)] == \
        [shapes.fp8_layer(edges, i) for i in range(8)] == [False] * 2 + [True] * 5 + [False]


def test_moe_layers_count_the_shared_expert_not_the_routed_ones():
    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
              ffn_hidden_size=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
              moe_shared_expert_intermediate_size=48, swiglu=True, fp8_format="hybrid",
              moe_layer_freq="[0]+[1]")
    m = ModelConfig(**kw)
    attention = 64 * (4 + 2 * 4) * 16 + 4 * 16 * 64
    assert fp8_gemm_flops_per_token(m) == 6.0 * (2 * attention + 3 * 64 * 128 + 3 * 64 * 48)


def test_fp8_gemms_run_at_the_fp8_rate():
    cluster = preset("h100", 1)
    bf16, fp8 = estimate_time(_config(), 8, cluster), estimate_time(_config(*FP8), 8, cluster)
    tokens = 64 * 2048
    saved = fp8_gemm_flops_per_token(_config(*FP8).model) * tokens / 8 * (
        1 / 989e12 - 1 / 1979e12) / cluster.matmul_efficiency
    # and the memory-bound work over what the layers save: fc2's [s, b, ffn/tp] input in
    # fp8, one byte less per element, the projection's [s, b, nh/tp d] one more (its fp8
    # copy beside the attention kernel's output); qkv's and fc1's gathered [s, b, h] in
    # fp8 are the bytes of their [s/tp, b, h] in bf16; 4 passes, 8 layers, 16
    # micro-batches (dp 4)
    saved += 4 * 8 * 2048 * (2816 // 2 - 16 * 64 // 2) * 16 / cluster.memory_rate
    # less the quantisation traffic. Per micro-batch and layer, the tp rank's linears
    # (M = 2048 tokens, gathered): qkv K 1024 N 768, proj K 512 N 1024, fc1 K 1024 N 2816,
    # fc2 K 1408 N 1024. Tensorwise in bf16: x read twice (amax, cast: 4 bytes), written as
    # qx (1; its transpose qx_t is in the memory-bound term above); dy read twice (4),
    # written as qg and qg_t (2)
    x_elements, dy_elements = 1024 + 512 + 1024 + 1408, 768 + 1024 + 2816 + 1024
    per_micro_batch = 8 * 2048 * (5 * x_elements + 6 * dy_elements)
    # per step each local weight quantised once (amax 2, cast 2 + 1) and transposed (1 + 1)
    local_weights = 8 * (1024 * 24 * 64 + 16 * 64 * 1024 + 3 * 1024 * 2816) // 2
    saved -= (16 * per_micro_batch + 7 * local_weights) / cluster.memory_rate
    assert bf16.compute - fp8.compute == pytest.approx(saved, rel=1e-9)
    assert fp8.model_flops == bf16.model_flops      # MFU: model FLOPs over the bf16 peak
    # at hidden 1024 the quantisations, at the presets' memory efficiency, cost more than
    # the fp8 GEMMs save: fp8 is the slower step here
    assert saved < 0 and fp8.mfu < bf16.mfu


def test_a_gpu_without_fp8_is_refused(capsys):
    tool = load_tool("plan_layout")
    flags = [f for f in LLAMA if f not in ("--mock-data", "--tokenizer-type", "NullTokenizer")]
    with pytest.raises(SystemExit):
        tool.plan(["--preset", "a100", "--tp", "2", "--pp", "1", "--", *flags, *FP8])
    err = capsys.readouterr().err
    assert "--fp8-format hybrid: the A100 SXM 80GB GPU has no fp8 GEMMs" in err


@pytest.mark.parametrize("recipe, fmt, cluster, emulated, better", [
    ("tensorwise", "hybrid", ["--preset", "h100"], None, None),
    ("blockwise", "e4m3", ["--preset", "h100"], None, None),
    ("blockwise", "hybrid", ["--preset", "h100"], "dgrad, wgrad", "--fp8-format e4m3 ("),
    ("mxfp8", "e4m3", ["--preset", "h200"], "fprop, dgrad, wgrad",
     "--fp8-recipe blockwise --fp8-format e4m3 ("),
    ("blockwise", "e4m3", ["--preset", "h100", "--no-fp8-block-kernel"],
     "fprop, dgrad, wgrad", "--fp8-recipe tensorwise or delayed runs"),
])
def test_the_report_names_the_fp8_gemms_it_times_as_emulated(capsys, recipe, fmt, cluster,
                                                             emulated, better):
    """The report's fp8 line gives the rate the fp8 GEMMs are timed at; a note names the
    GEMMs megalite has no fp8 kernel for on the cluster (timed as the fp32 products it runs
    instead) and the recipe that runs them in fp8."""
    tool = load_tool("plan_layout")
    flags = [f for f in LLAMA if f not in ("--mock-data", "--tokenizer-type", "NullTokenizer")]
    assert tool.main([*cluster, "--tp", "2", "--pp", "1", "--top", "1", "--", *flags,
                      "--fp8-format", fmt, "--fp8-recipe", recipe]) == 0
    out = capsys.readouterr().out
    assert f"fp8 ({recipe}, {fmt}): GEMMs at 1979 TFLOP/s, the quantisation passes" in out
    notes = [line for line in out.splitlines() if line.startswith("note: megalite has no fp8")]
    if emulated is None:
        assert notes == []
    else:
        (note,) = notes
        assert f"--fp8-recipe {recipe}'s {emulated} GEMMs on the H" in note
        assert "multiplied in fp32, 67 TFLOP/s" in note and better in note
