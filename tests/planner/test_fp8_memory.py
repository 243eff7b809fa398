"""The planner's activation memory under ``--fp8-format``: an fp8 linear
(:mod:`megalite.layers.fp8.gemm`) keeps its whole input (gathered under sequence
parallelism) quantised, one byte each, under per-tensor recipes (the input itself instead
under ``--no-fp8-wgrad``), or the input itself under block recipes; every recipe also keeps
two fp8 copies of each fp8 linear's weight (``[N, K]`` and ``[K, N]``, with their block
scales under block recipes) through the step. Hand counts on a tiny layer, tp 2 with
sequence parallelism."""

from __future__ import annotations

from megalite.config import ModelConfig, ParallelConfig
from megalite.planner.fp8_memory import (
    cpu_fp8_gemm_bytes,
    fp8_expert_weight_copies,
    fp8_step_copies,
    fp8_weight_copies,
)
from megalite.planner.memory import estimate_memory, layer_activation_elements

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
            ffn_hidden_size=128, hidden_dropout=0.0)
TP2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
TOKENS, H, PROJ, F = 32 * 2, 64, 4 * 16 // 2, 128 // 2   # micro-batch 2; per tp rank


def _elements(fp8=True, p=TP2, **kw):
    m = ModelConfig(**{**TINY, **kw})
    return layer_activation_elements(m, p, 2, fp8=fp8)


def test_per_tensor_recipes_keep_the_gathered_inputs_in_fp8():
    bf16 = _elements(fp8=False)
    # qkv and fc1 keep their [s/tp, b, h] input in bf16, fc2 its [s, b, ffn/tp]; the
    # projection's input is the attention kernel's output, which the kernel keeps anyway
    own = 2 * TOKENS * H // 2 + TOKENS * F
    # in fp8 each keeps its whole input quantised (qkv and fc1 the gathered [s, b, h])
    whole = 2 * TOKENS * H + TOKENS * PROJ + TOKENS * F
    for recipe in ("tensorwise", "delayed"):
        e = _elements(fp8_format="hybrid", fp8_recipe=recipe)
        assert e == {"act": bf16["act"] - own, "fp32": bf16["fp32"], "fp8": whole}
    assert bf16["fp8"] == 0
    # the same model outside an fp8 layer (--first-last-layers-bf16) keeps bf16
    assert _elements(fp8=False, fp8_format="hybrid") == bf16
    # --no-fp8-wgrad: the weight gradient takes the unquantised (whole) input instead of
    # an fp8 copy (the projection's is the kernel's output, already counted)
    e = _elements(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False)
    assert e == {"act": bf16["act"] - own + whole - TOKENS * PROJ, "fp32": bf16["fp32"],
                 "fp8": 0}
    # --recompute-modules core_attn: the kernel keeps nothing, the projection its fp8 copy
    sel = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    bf16_sel = _elements(fp8=False, **sel)
    e = _elements(fp8_format="hybrid", fp8_recipe="tensorwise", **sel)
    assert e["act"] == bf16_sel["act"] - own - TOKENS * PROJ and e["fp8"] == whole


def test_block_recipes_keep_the_gathered_inputs_in_bf16():
    """Hidden 128, ffn 256 (multiples of the blocks): under sp qkv's and fc1's gathered
    inputs are kept whole, in bf16: tp times their [s/tp, b, h]."""
    bf16 = _elements(fp8=False, hidden_size=128, ffn_hidden_size=256)
    own = 2 * TOKENS * 128 // 2 + TOKENS * 128 // 2 + TOKENS * 128
    whole = 2 * TOKENS * 128 + TOKENS * 128 // 2 + TOKENS * 128
    for recipe in ("mxfp8", "blockwise"):
        e = _elements(fp8_format="e4m3", fp8_recipe=recipe, hidden_size=128,
                      ffn_hidden_size=256)
        assert e == {"act": bf16["act"] - own + whole, "fp32": bf16["fp32"], "fp8": 0}
    # without sequence parallelism nothing is gathered: the same bytes as bf16
    no_sp = ParallelConfig(tensor_model_parallel_size=2)
    assert _elements(p=no_sp, fp8_format="e4m3", fp8_recipe="blockwise", hidden_size=128,
                     ffn_hidden_size=256) == \
        _elements(fp8=False, p=no_sp, hidden_size=128, ffn_hidden_size=256)


def test_recomputed_mlp_keeps_only_its_bf16_input():
    bf16 = _elements(fp8=False, recompute_granularity="selective", recompute_modules=["mlp"])
    e = _elements(fp8_format="hybrid", fp8_recipe="tensorwise",
                  recompute_granularity="selective", recompute_modules=["mlp"])
    # only attention's qkv and projection change
    assert e["fp8"] == TOKENS * H + TOKENS * PROJ
    assert e["act"] == bf16["act"] - TOKENS * H // 2


def test_shared_expert_inputs_in_fp8_routed_experts_unchanged():
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               moe_shared_expert_intermediate_size=64, moe_layer_freq=1)
    m = ModelConfig(**{**TINY, **moe})
    bf16 = layer_activation_elements(m, TP2, 2, moe=True)
    m8 = ModelConfig(**{**TINY, **moe, "fp8_format": "hybrid", "fp8_recipe": "tensorwise"})
    e = layer_activation_elements(m8, TP2, 2, moe=True, fp8=True)
    shared_in, shared_mid = TOKENS * H, TOKENS * 64 // 2
    assert e["fp8"] == TOKENS * H + TOKENS * PROJ + shared_in + shared_mid
    assert e["act"] == bf16["act"] - TOKENS * H // 2 - shared_in - shared_mid


def test_fp8_weight_copies_kept_per_step():
    m = ModelConfig(**TINY, fp8_format="hybrid", fp8_recipe="tensorwise",
                    first_last_layers_bf16=True)
    # the middle two of 4 layers run fp8: qkv [3 x 64, 64], proj [64, 64], fc1 [128, 64],
    # fc2 [64, 128], a tp 2 slice of each, fp8 [N, K] and its transpose [K, N]
    per_layer = (3 * 64 * 64 + 64 * 64 + 2 * 64 * 128) // 2
    assert fp8_weight_copies(m, TP2, 0) == 2 * 2 * per_layer
    # block recipes: along K and along N, each with a scale byte per 32 elements (e8m0 per
    # 32, or fp32 per 128), all 4 layers
    for recipe in ("mxfp8", "blockwise"):
        blocks = ModelConfig(**TINY, fp8_format="e4m3", fp8_recipe=recipe)
        assert fp8_weight_copies(blocks, TP2, 0) == 4 * 2 * (per_layer + per_layer // 32)
    assert fp8_weight_copies(ModelConfig(**TINY), TP2, 0) == 0


def test_fp8_expert_weight_copies_kept_per_step():
    """The routed experts' weights in two fp8 layouts each, with their scales, per fp8 MoE
    layer (4 experts at ep 2: 2 local; fc1 [2, 64, 2 x 32], fc2 [2, 32, 64])."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, swiglu=True,
               moe_layer_freq=1, first_last_layers_bf16=True)
    ep2 = ParallelConfig(expert_model_parallel_size=2)
    elements = 2 * (64 * 64 + 32 * 64)
    rows = 2 * (64 + 64 + 64 + 32)     # fc1^T, fc1, fc2^T, fc2: a fp32 scale per row
    m = ModelConfig(**{**TINY, **moe, "fp8_format": "hybrid", "fp8_recipe": "tensorwise"})
    assert fp8_expert_weight_copies(m, ep2, 0) == 2 * (2 * elements + 4 * rows)  # 2 fp8 layers
    m = ModelConfig(**{**TINY, **moe, "fp8_format": "e4m3", "fp8_recipe": "mxfp8"})
    assert fp8_expert_weight_copies(m, ep2, 0) == 2 * (2 * elements + 2 * elements // 32)
    assert fp8_expert_weight_copies(ModelConfig(**{**TINY, **moe}), ep2, 0) == 0
    assert fp8_expert_weight_copies(ModelConfig(**TINY, fp8_format="hybrid"), ep2, 0) == 0


def test_estimate_memory_counts_the_fp8_savings():
    from megalite.arguments import parse_args

    base = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
            "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--ffn-hidden-size", "4096", "--vocab-size", "32000", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--bf16", "--hidden-dropout", "0",
            "--tokenizer-type", "NullTokenizer", "--mock-data"]
    bf16 = estimate_memory(parse_args(base).validate(1), 1)
    fp8 = estimate_memory(parse_args(base + ["--fp8-format", "hybrid", "--fp8-recipe",
                                             "tensorwise"]).validate(1), 1)
    tokens, h, f, layers = 2048, 1024, 4096, 4
    # per layer qkv's, fc1's and fc2's inputs lose a byte per element, the projection's
    # gains its fp8 copy; the weights' fp8 copies ([N, K] and [K, N]) come on top
    inputs = tokens * (h - h + h + f)
    weights = 2 * (4 * h * h + 2 * h * f)
    assert bf16.activations - fp8.activations == layers * (inputs - weights)


def test_zero3_keeps_the_copies_of_the_gathered_layers_only():
    """Under optim_grads_params a freed unit forgets its fp8 copies: at most the running
    layer's and its neighbour's are held (the two largest of the stage's fp8 layers);
    under the other strategies every fp8 layer's, through the step."""
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, swiglu=True,
               moe_layer_freq=[1, 0, 1, 0])
    m = ModelConfig(**{**TINY, **moe, "fp8_format": "hybrid", "fp8_recipe": "tensorwise"})
    p = ParallelConfig(expert_model_parallel_size=2)
    attention, mlp = 3 * 64 * 64 + 64 * 64, 2 * 128 * 64 + 64 * 128   # swiglu fc1, fc2
    experts = fp8_expert_weight_copies(m, p, 0) // 2       # layers 0 and 2
    moe_layer, dense_layer = 2 * attention + experts, 2 * (attention + mlp)
    assert moe_layer < dense_layer
    assert fp8_weight_copies(m, p, 0) == 2 * (4 * attention + 2 * mlp)
    assert fp8_step_copies(m, p, 0, "optim") == 2 * moe_layer + 2 * dense_layer
    assert fp8_step_copies(m, p, 0, "optim_grads_params") == 2 * dense_layer
    assert fp8_step_copies(ModelConfig(**TINY), p, 0, "optim_grads_params") == 0


def test_cpu_fp8_gemms_count_the_emulations_fp32_operands():
    """On a CPU torch._scaled_mm multiplies fp32 copies of its fp8 operands: 4 (a + 2 b)
    bytes for ``a`` then ``b``, beyond its output (measured here with the profiler, so the
    term goes stale if torch gains a CPU kernel reading fp8); the planner counts the
    largest of the fp8 linears' three GEMMs."""
    import torch

    from megalite.layers.fp8.gemm import scaled_mm
    from megalite.planner.measure import peak_allocated

    mm, k, n = 64, 32, 96
    a = torch.randn(mm, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    _, peak = peak_allocated(lambda: scaled_mm(a, b, one, one))
    assert peak >= 4 * (mm * k + 2 * n * k) + 4 * mm * n
    # tp 2, micro-batch 2 x seq 32: qkv [64 tokens, 64 -> 96] has the largest: its input
    # gradient's dy [64, 96] and w^T [64, 96], 4 x (6144 + 2 x 6144) bytes
    m = ModelConfig(**TINY, fp8_format="hybrid", fp8_recipe="tensorwise")
    assert cpu_fp8_gemm_bytes(m, 2, 64, [0, 1, 2, 3]) == 4 * (64 * 96 + 2 * 64 * 96)
    blocks = ModelConfig(**TINY, fp8_format="e4m3", fp8_recipe="mxfp8")
    assert cpu_fp8_gemm_bytes(blocks, 2, 64, [0]) == 0
    assert cpu_fp8_gemm_bytes(ModelConfig(**TINY), 2, 64, [0]) == 0
