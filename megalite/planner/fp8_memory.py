"""What ``--fp8-format`` adds to the memory of a rank, in elements and bytes: the terms
:func:`megalite.planner.memory.estimate_memory` (and :mod:`megalite.planner.time`) take for
fp8 layers (:func:`megalite.config.shapes.fp8_layer`).

* what an fp8 linear keeps of its input for backward (:func:`fp8_linear_input`);
* the fp8 weight copies a step keeps of the tensor-parallel linears
  (:func:`fp8_weight_copies`) and of the routed experts (:func:`fp8_expert_weight_copies`),
  and those live at a step's peak (:func:`fp8_step_copies`; under ZeRO-3 the gathered
  units' only);
* the weight elements the fp8 linears hold (:func:`fp8_linear_weights`, whole;
  :func:`fp8_weight_elements`, this rank's under per-tensor recipes);
* on a CPU, the fp32 copies ``torch._scaled_mm`` makes of a per-tensor fp8 GEMM's operands
  (:func:`cpu_fp8_gemm_bytes`).
"""

from __future__ import annotations

from megalite.config.shapes import (attention_gemms, fp8_layer, is_moe_layer, layer_gemms,
                                    mla_up_proj_params)
from megalite.layers.fp8.recipes import BLOCK_RECIPES
from megalite.planner.schedule import stage_layers


def fp8_linear_input(m, elements: int) -> tuple[int, int]:
    """(training-dtype, one-byte) elements an fp8 linear keeps of an input of
    ``elements`` (:class:`megalite.layers.fp8.gemm.Fp8LinearFunction`): per-tensor recipes
    (delayed, tensorwise) its fp8 quantisation (transposed, the weight gradient's
    operand), or under ``--no-fp8-wgrad`` the input itself instead; block recipes (mxfp8,
    blockwise) the input itself (quantised again per GEMM)."""
    if m.fp8_recipe in BLOCK_RECIPES or not m.fp8_wgrad:
        return elements, 0
    return 0, elements


def fp8_weight_copies(m, p, pp_rank: int) -> int:
    """Bytes of the fp8 weights kept through a training step on pipeline rank ``pp_rank``
    (:class:`megalite.layers.fp8.scaling.StepWeights`: both quantised at the step's first
    forward, dropped before the optimizer), per local weight
    element of each fp8 layer's tensor-parallel linears: two bytes under the per-tensor
    recipes (``[N, K]`` and its transpose ``[K, N]``), two and two 32nds under the block
    recipes (along K and along N, each with one e8m0 byte per 32 elements under mxfp8 or
    one fp32 scale per 128 under blockwise); 0 without fp8."""
    return sum(_fp8_dense_copies(m, p, layer) for layer in stage_layers(m, p, pp_rank))


def _fp8_dense_elements(m, p, layer: int) -> int:
    """Local weight elements of global layer ``layer``'s fp8 tensor-parallel linears (0
    when the layer is not fp8)."""
    if m.fp8_format is None or not fp8_layer(m, layer):
        return 0
    return fp8_linear_weights(m, layer) // p.tensor_model_parallel_size


def _fp8_dense_copies(m, p, layer: int) -> int:
    """:func:`fp8_weight_copies` of global layer ``layer`` alone."""
    elements = _fp8_dense_elements(m, p, layer)
    if m.fp8_recipe in BLOCK_RECIPES:
        return 2 * elements + 2 * (elements // 32)
    return 2 * elements


def fp8_step_copies(m, p, pp_rank: int, strategy: str) -> int:
    """Bytes of the fp8 weight copies (dense linears' and routed experts') live at the peak
    of a training step on ``pp_rank``: every fp8 layer's, or under optim_grads_params
    (ZeRO-3, whose freed units forget them) the two largest layers' -- the running unit
    and the one gathered beside it."""
    per_layer = sorted((_fp8_dense_copies(m, p, layer) + _fp8_expert_copies(m, p, layer)
                        for layer in stage_layers(m, p, pp_rank)), reverse=True)
    return sum(per_layer[:2] if strategy == "optim_grads_params" else per_layer)


def fp8_weight_elements(m, p, pp_rank: int) -> int:
    """Local weight elements of the tensor-parallel linears per-tensor fp8 recipes
    quantise once per step on pipeline rank ``pp_rank`` (those ``--fp8-param-gather``
    gathers in fp8); 0 under block recipes or without fp8."""
    if m.fp8_format is None or m.fp8_recipe in BLOCK_RECIPES:
        return 0
    return sum(_fp8_dense_elements(m, p, layer) for layer in stage_layers(m, p, pp_rank))


def fp8_expert_weight_copies(m, p, pp_rank: int) -> int:
    """Bytes of the routed experts' fp8 weight quantisations kept through a training step
    on pipeline rank ``pp_rank`` (:class:`megalite.moe.fp8_experts.Fp8ExpertWeights`:
    made at the step's first forward and first backward, dropped before the optimizer):
    for each fp8 MoE layer's local experts (fc1 ``[E_l, h, f1 / etp]``, fc2
    ``[E_l, f / etp, h]``) one byte per element in each of two layouts (along the
    forward's contraction and along the input gradient's), with their scales: one fp32
    per row of each layout (per-tensor recipes: per-row scaling), or a byte per 32
    elements (block recipes); 0 without fp8 or experts."""
    return sum(_fp8_expert_copies(m, p, layer) for layer in stage_layers(m, p, pp_rank))


def _fp8_expert_copies(m, p, layer: int) -> int:
    """:func:`fp8_expert_weight_copies` of global layer ``layer`` alone."""
    if m.fp8_format is None or not m.num_experts or not is_moe_layer(m, layer) \
            or not fp8_layer(m, layer):
        return 0
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    h, f1 = m.hidden_size, (2 if m.swiglu else 1) * m.moe_ffn_hidden_size // etp
    f2, local = m.moe_ffn_hidden_size // etp, m.num_experts // ep
    elements = local * (h * f1 + f2 * h)
    if m.fp8_recipe in BLOCK_RECIPES:
        return 2 * elements + 2 * (elements // 32)
    # rows: fc1^T [f1, h] and fc1 [h, f1]; fc2^T [h, f2] and fc2 [f2, h]
    return 2 * elements + 4 * local * (f1 + h + h + f2)


def fp8_linear_weights(m, layer: int) -> int:
    """Weight elements of the linears ``--fp8-format`` runs in fp8 in global layer
    ``layer`` (whole, over all tp ranks): attention's qkv and output projections, or
    multi-latent attention's up and output projections; the dense MLP, or an MoE layer's
    shared expert (not the routed experts' grouped GEMMs)."""
    h, n = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        attention = mla_up_proj_params(m) + n * m.v_head_dim * h
    else:
        attention = h * (n + 2 * m.num_query_groups) * m.kv_channels + n * m.kv_channels * h
    mult = 3 if m.swiglu else 2
    if is_moe_layer(m, layer):
        return attention + h * (m.moe_shared_expert_intermediate_size or 0) * mult
    return attention + h * m.ffn_hidden_size * mult


def cpu_fp8_gemm_bytes(m, tp: int, tokens: int, layers: list) -> int:
    """The working set a per-tensor fp8 GEMM adds on a CPU, where ``torch._scaled_mm``
    (:func:`megalite.layers.fp8.gemm.scaled_mm`) multiplies fp32 copies of its operands:
    ``a`` dequantised (4 bytes per element), then ``b`` converted and dequantised (two
    copies at once), ``4 (a + 2 b)`` bytes; on a GPU the kernel reads the fp8 bytes. The
    largest over the three GEMMs of the fp8 linears of ``layers`` (``a`` / ``b``: fprop
    ``x [M, K]`` / ``w [N, K]``, dgrad ``dy [M, N]`` / ``w^T [K, N]``, wgrad ``dy^T [N, M]``
    / ``x^T [K, M]``, ``M`` the micro-batch's ``tokens``); 0 without per-tensor fp8."""
    if m.fp8_format is None or m.fp8_recipe in BLOCK_RECIPES:
        return 0
    most = 0
    for layer in layers:
        if not fp8_layer(m, layer):
            continue
        gemms = (attention_gemms(m, tokens, tp) if is_moe_layer(m, layer)
                 else layer_gemms(m, tokens, tp))
        for mm, k, n in gemms:
            most = max(most, mm * k + 2 * n * k, mm * n + 2 * k * n, n * mm + 2 * k * mm)
    return 4 * most
