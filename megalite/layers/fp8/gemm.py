"""The three GEMMs of a linear layer in fp8: forward, input gradient, weight gradient.

``y = x w^T + b`` with ``x`` ``[..., K]``, ``w`` ``[N, K]``:

======  ====================  ===================  ======================
GEMM    product               contraction          operands (hybrid)
======  ====================  ===================  ======================
fprop   ``y = x w^T``         K (in features)      x e4m3, w e4m3
dgrad   ``dx = dy w``         N (out features)     dy e5m2, w e4m3
wgrad   ``dw = dy^T x``       M (tokens)           dy e5m2, x e4m3
======  ====================  ===================  ======================

Per-tensor recipes (tensorwise, delayed) quantise, per micro-batch, ``x`` once into the
two layouts its GEMMs take (``[M, K]`` for fprop, ``[K, M]`` for wgrad: the one fp8 copy
saved for backward) and ``dy`` once into ``[M, N]`` (dgrad) and ``[N, M]`` (wgrad)
(:func:`~megalite.layers.fp8.recipes.quantize_both`); ``w`` once per training step
(:meth:`~megalite.layers.fp8.scaling.Fp8Scaling.weight_fp8`), transposed once per step
for dgrad (:meth:`~megalite.layers.fp8.scaling.Fp8Scaling.weight_fp8_t`); the forward
saves the weight, not its fp8 copy, which backward takes from the scaling again (under
ZeRO-3 the copies live only while the layer's unit is gathered). They run
``torch._scaled_mm`` (it takes per-tensor scales on the CPU and on GPUs of compute
capability 8.9+, accumulating in fp32, on a GPU the forward with fast accumulation,
:data:`FPROP_FAST_ACCUM`; ``a`` row-major, ``b`` column-major, hence the layouts); where
the kernel cannot take the operands (another GPU, or a dimension not a multiple of 16 on
a GPU) the same product is formed from the dequantised operands in fp32, which equals
the kernel's result up to the order of summation.

Block recipes (mxfp8, blockwise) quantise each operand along the contraction dimension
of each GEMM: ``x`` and ``dy`` twice per micro-batch (once per GEMM they enter), ``w``
along K (fprop) and ``w^T`` along N (dgrad) once per training step each
(:meth:`~megalite.layers.fp8.scaling.Fp8Scaling.block_weight`); :func:`block_mm`
multiplies them: ``blockwise`` on a GPU of compute capability 9.0 (Hopper) with torch's
block-scaled kernel (``torch.nn.functional.scaled_mm`` with 1 x 128 fp32 scales on both
e4m3 operands, cuBLAS 12.9+, :func:`block_kernel_takes`), everywhere else the dequantised blocks
in fp32: exact emulation of a block-scaled kernel accumulating in fp32. torch's MX kernel
(e8m0 scales in a swizzled layout) exists only on compute capability 10.0 and is not
called yet: ``mxfp8`` is emulated on every device.

Outside training (evaluation) every operand, the weight included, is quantised afresh
at every call and nothing is kept.
The output, input gradient and weight gradient are returned in the dtype of ``x`` /
``w`` (fp32 or bf16); the bias and its gradient stay in that precision. With
``--no-fp8-wgrad`` (Megatron-LM's flag) the weight gradient is ``dy^T x`` of the
unquantised operands, in the training precision.
"""

from __future__ import annotations

import torch

from megalite.layers.fp8.recipes import (
    block_dequantize,
    block_quantize,
    quantize,
    quantize_both,
)
from megalite.layers.fp8.scaling import GRAD, INPUT


FPROP_FAST_ACCUM = True
"""The forward GEMM on a CUDA GPU runs ``torch._scaled_mm`` with ``use_fast_accum=True``:
Hopper's fp8 tensor cores then keep adding in their reduced-precision accumulator
instead of promoting partial sums to fp32 at intervals, which is faster; the input- and
weight-gradient GEMMs keep the promotion (their gradients are the more sensitive, and
wgrad contracts over all tokens). Transformer Engine's recipes split fprop and the
gradient GEMMs the same way and torchao's float8 training uses fast accumulation for the
output GEMM by default; Megatron-LM has no flag for it, so neither has megalite. The
CPU kernel and the fp32 emulation have no such mode: CPU results do not change."""


SCALED_MM = torch.ops.aten._scaled_mm.default
"""The kernel, called as the aten operator ``(a, b, scale_a, scale_b, bias, scale_result,
out_dtype, use_fast_accum)`` rather than through ``torch._scaled_mm``: ``--compile``
traces an operator into the layer's graph whatever happens to the ``torch._scaled_mm``
binding (on an H200 with torch 2.11, a test that had replaced the binding for a while
before the process's first compile left dynamo treating the real one as an untraceable
builtin: a graph break at every fp8 linear). Tests that count the kernel's calls
replace this name instead."""


def _kernel_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        return True
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    return all(n % 16 == 0 for n in (*a.shape, b.shape[0]))


def scaled_mm(a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor,
              out_dtype: torch.dtype = torch.float32, fast_accum: bool = False
              ) -> torch.Tensor:
    """``(a * da) @ (b * db)^T`` accumulated in fp32: ``a`` ``[M, K]``, ``b`` ``[N, K]`` fp8
    (row-major), ``da`` / ``db`` 0-d fp32 dequantisation scales -> ``[M, N]`` in
    ``out_dtype``. A GPU kernel rounds its fp32 accumulator to ``out_dtype`` in its
    epilogue (no fp32 ``[M, N]`` in memory); elsewhere the fp32 result is cast.
    ``fast_accum``: the CUDA kernel's fast accumulation (:data:`FPROP_FAST_ACCUM`);
    ignored elsewhere."""
    if _kernel_takes(a, b):
        cuda = a.device.type == "cuda"
        y = SCALED_MM(a, b.t(), da, db, None, None, out_dtype if cuda else torch.float32,
                      fast_accum and cuda)
    else:
        y = (a.float() * da) @ (b.float() * db).t()
    return y.to(out_dtype)


BLOCK_SCALED_MM = getattr(torch.nn.functional, "scaled_mm", None)
"""torch's scaled GEMM that takes block scales (torch 2.10+; None before), called by
:func:`block_mm` where :func:`block_kernel_takes`, through the operator
``megalite::block_scaled_mm``. Tests that count or check its calls replace this name."""


@torch.library.custom_op("megalite::block_scaled_mm", mutates_args=())
def _block_scaled_mm(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """:data:`BLOCK_SCALED_MM` of ``qa`` ``[M, K]`` and ``qb`` ``[N, K]`` (row-major e4m3)
    with 1 x 128 scales ``sa`` ``[M, K / 128]`` and ``sb`` ``[N, K / 128]`` -> ``[M, N]``
    ``out_dtype``; ``b`` handed over column-major and the scales outer-dimension-major, as
    cuBLAS reads them. An operator of its own, opaque to ``--compile``: dynamo traces it
    into the layer's graph by its shapes (:func:`_block_scaled_mm_shape`) whether or not it
    can trace torch's binding (on an H200 with torch 2.11 it could not: a graph break at
    every blockwise linear)."""
    one_by = torch.nn.functional.ScalingType.BlockWise1x128
    return BLOCK_SCALED_MM(qa, qb.t(), sa.t().contiguous().t(), one_by,
                           sb.t().contiguous().t(), one_by, output_dtype=out_dtype)


@_block_scaled_mm.register_fake
def _block_scaled_mm_shape(qa, qb, sa, sb, out_dtype):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


def _cuda_version() -> tuple[int, ...]:
    version = torch.version.cuda or "0"
    return tuple(int(v) for v in version.split(".")[:2] if v.isdigit())


def block_kernel_takes(a: torch.Tensor, b: torch.Tensor, block: int, mx: bool) -> bool:
    """Whether :func:`block_mm` runs torch's block-scaled kernel for ``a`` ``[M, K]`` and
    ``b`` ``[N, K]``: ``blockwise`` scales (fp32, 1 x 128; not MX) of e4m3 operands (as
    DeepSeek-V3 and Megatron-LM's blockwise recipe run every GEMM; ``hybrid``'s e5m2
    gradient GEMMs stay emulated: torch refuses an e5m2 operand with block scales,
    "Invalid scaling configuration", on an H200 with torch 2.11 and CUDA 13.0) on a CUDA
    GPU of compute capability 9.0 (cuBLAS has 1 x 128 block scaling only there, from CUDA
    12.9), ``M`` and ``N`` multiples of 16 as for the per-tensor kernel."""
    if mx or block != 128 or a.device.type != "cuda" or BLOCK_SCALED_MM is None:
        return False
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return False
    if torch.cuda.get_device_capability(a.device) != (9, 0) or _cuda_version() < (12, 9):
        return False
    return a.shape[0] % 16 == 0 and b.shape[0] % 16 == 0


def block_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
             out_dtype: torch.dtype, mx: bool) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T`` in ``out_dtype``: ``qa`` ``[M, K]`` and ``qb`` ``[N, K]``
    fp8 (row-major), block-quantised along K with scales ``sa`` ``[M, K / block]`` and
    ``sb`` ``[N, K / block]`` (:func:`~megalite.layers.fp8.recipes.block_quantize`).
    torch's kernel where :func:`block_kernel_takes` (``b`` given column-major as ``[K, N]``,
    the scales outer-dimension-major, as cuBLAS reads them; fp32 accumulation, the block
    scales applied in the main loop), else the fp32 product of the dequantised blocks."""
    block = qa.shape[-1] // sa.shape[-1]
    if block_kernel_takes(qa, qb, block, mx):
        return torch.ops.megalite.block_scaled_mm(qa, qb, sa, sb, out_dtype)
    return (block_dequantize(qa, sa) @ block_dequantize(qb, sb).t()).to(out_dtype)


class Fp8LinearFunction(torch.autograd.Function):
    """``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None, ``scaling`` an
    :class:`~megalite.layers.fp8.scaling.Fp8Scaling`, and the weight's operands that
    :func:`fp8_linear` took from the scaling before the call: ``qw`` (fp8 ``[N, K]``) with
    its dequantisation scales ``dw`` (per-tensor recipes: 0-d fp32; block recipes: ``[N, K
    / block]``), and ``qw_t`` (fp8 ``[K, N]``, or None when backward asks the scaling for
    it) with its ``dw_t`` (block recipes: ``[K, N / block]``; per-tensor recipes: None, the
    scale is ``dw``) -> ``[..., N]``; collectives only those of ``scaling`` (tensorwise
    amaxes).

    Neither pass touches the scaling's Python state (the step's weight copies are read
    and made in :func:`fp8_linear`; delayed scaling's amax records are buffer writes,
    which compiled graphs keep), so ``torch.compile`` traces the function into the
    layer's graph and fuses each quantisation with its neighbours. It still runs eagerly
    inside a compiled layer under ZeRO-3 (backward asks the scaling for the copies again)
    and where an amax is all-reduced over tp or cp (megalite's collectives break the
    graph there, as they do for the layers' own tp collectives)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling, dw, qw, qw_t, dw_t):
        recipe = scaling.recipe
        record = scaling.training
        x2 = x.reshape(-1, x.shape[-1])
        fwd = recipe.forward_dtype
        block = recipe.block
        if block is not None:
            mx = recipe.recipe == "mxfp8"
            y = block_mm(*block_quantize(x2, block, fwd, mx=mx), qw, dw, x.dtype, mx)
            # backward's operand of the weight: w^T along N, or the weight to make it from
            kept = (None, qw_t, dw_t) if qw_t is not None else (weight, None, None)
            ctx.save_for_backward(x2, *kept)
        else:
            dx = scaling.scale(INPUT, x2, fwd, record)
            if recipe.wgrad:   # wgrad's operand: x^T [K, M], quantised with x itself
                qx, qx_t = quantize_both(x2, dx, fwd)
            else:              # --no-fp8-wgrad: the weight gradient from x itself
                qx, qx_t = quantize(x2, dx, fwd), None
            y = scaled_mm(qx, qw, dx, dw, x.dtype, fast_accum=FPROP_FAST_ACCUM)
            # what backward's input gradient needs of the weight: the transposed copy when
            # the caller holds it through the step; under ZeRO-3 (record, no qw_t) the
            # weight, whose copies backward asks the scaling for again (made again after
            # the unit's gather); outside training the fp8 copy itself
            kept = ((None, None, dw, qw_t) if qw_t is not None
                    else (weight, None, None, None) if record else (None, qw, dw, None))
            ctx.save_for_backward(qx_t, dx, None if recipe.wgrad else x2, *kept)
        ctx.scaling, ctx.record, ctx.has_bias = scaling, record, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        y = y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        scaling = ctx.scaling
        recipe = scaling.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        gdt, fwd = recipe.grad_dtype, recipe.forward_dtype
        gw = None
        if recipe.block is not None:
            x2, weight, qw_t, dw_t = ctx.saved_tensors
            mx = recipe.recipe == "mxfp8"
            block = recipe.block
            if qw_t is None:       # ZeRO-3: the step's copy, or one made after the gather
                qw_t, dw_t = scaling.block_weight(weight, True, ctx.record)
            gx = block_mm(*block_quantize(g2, block, gdt, mx=mx), qw_t, dw_t, ctx.x_dtype, mx)
            if ctx.needs_input_grad[1] and recipe.wgrad:   # both along M, the tokens
                gw = block_mm(*block_quantize(g2.t(), block, gdt, mx=mx),
                              *block_quantize(x2.t(), block, fwd, mx=mx), ctx.w_dtype, mx)
        else:
            qx_t, dx, x2, weight, qw, dw, qw_t = ctx.saved_tensors
            if qw_t is None:
                if qw is None:     # ZeRO-3: the step's copy, or one made after the gather
                    dw, qw = scaling.weight_fp8(weight, fwd, ctx.record)
                qw_t = scaling.weight_fp8_t(qw, ctx.record)
            dg = scaling.scale(GRAD, g2, gdt, ctx.record)
            fp8_wgrad = ctx.needs_input_grad[1] and recipe.wgrad
            if fp8_wgrad:      # dy [M, N] for dgrad and dy^T [N, M] for wgrad, at once
                qg, qg_t = quantize_both(g2, dg, gdt)
            else:
                qg = quantize(g2, dg, gdt)
            gx = scaled_mm(qg, qw_t, dg, dw, ctx.x_dtype)
            if fp8_wgrad:
                gw = scaled_mm(qg_t, qx_t, dg, dx, ctx.w_dtype)
        if ctx.needs_input_grad[1] and not recipe.wgrad:   # in the training precision
            gw = g2.t().mm(x2)
        gx = gx.to(ctx.x_dtype).view(ctx.x_shape)
        gw = None if gw is None else gw.to(ctx.w_dtype)
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scaling) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its three GEMMs in fp8 (module docstring). The
    weight's operands come from ``scaling`` here, before the autograd function
    (:meth:`~megalite.layers.fp8.scaling.Fp8Scaling.weight_operands`), so that the
    function touches no Python state and ``--compile`` traces it whole."""
    dw, qw, qw_t, dw_t = scaling.weight_operands(weight, scaling.training)
    return Fp8LinearFunction.apply(x, weight, bias, scaling, dw, qw, qw_t, dw_t)
