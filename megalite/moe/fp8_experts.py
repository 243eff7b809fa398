"""The routed experts' grouped GEMMs in fp8, with scales that do not depend on the layout.

A per-tensor scale of an expert's input would be the amax over the tokens that reach the
expert in one GEMM, and which tokens those are depends on the layout: at dp2 x ep2 an
expert's owner multiplies two data-parallel ranks' micro-batches at once, where one
process multiplies them one after the other. So the experts scale along the contraction
dimension only, per row, which a token owns whatever the layout:

- activations and output gradients: one scale per token row (``tensorwise`` and
  ``delayed``: current scaling from the row's amax; delayed histories are per tensor and
  have no per-row form), or per block of 32 (``mxfp8``, e8m0) / 128 (``blockwise``) of it;
- weights: one scale per output channel of each expert (the column the contraction runs
  down), or per block of it.

Where the contraction dimension is split over expert tensor parallelism (fc2's input
features in forward, fc1's output features in the input gradient) a row's amax is the
maximum over ``ps.etp`` (per-row scales; blocks never cross a shard, as the tiling check
ensures). The input-gradient GEMM is fp8 like the forward; the weight gradient
``x^T dy`` contracts over the tokens, whose grouping is the layout's, so it stays in the
training precision (as ``--no-fp8-wgrad`` keeps it for the dense linears).

The products are formed from the dequantised operands in fp32: what a row- or
block-scaled kernel accumulating in fp32 computes, up to the order of the sums.
"""

from __future__ import annotations

import torch

from megalite.layers.fp8.recipes import (
    Fp8Recipe,
    block_dequantize,
    block_quantize,
    dequant_scale,
    quantize,
)
from megalite.parallel import collectives as C
from megalite.parallel.collectives import ReduceOp


def _dequantised(x: torch.Tensor, recipe: Fp8Recipe, dtype: torch.dtype, group
                 ) -> torch.Tensor:
    """``x`` ``[..., K]`` quantised along K and back, fp32: per row (the row's amax, a MAX
    over ``group`` when K is split over it; ``group`` None: K is whole) or per block."""
    if recipe.block is not None:
        q, scales = block_quantize(x, recipe.block, dtype, mx=recipe.recipe == "mxfp8")
        return block_dequantize(q, scales)
    amax = x.detach().abs().amax(-1, keepdim=True).float().contiguous()
    if group is not None:
        C.all_reduce(amax, group, ReduceOp.MAX)
    d = dequant_scale(amax, dtype, recipe.margin)
    return quantize(x, d, dtype).float() * d


class Fp8ExpertBmm(torch.autograd.Function):
    """``x`` ``[E, C, a]`` @ ``w`` ``[E, a, b]`` -> ``[E, C, b]`` in ``x``'s dtype, forward
    and input gradient in fp8 (module docstring), the weight gradient in the training
    precision. ``split_in``: ``a`` is split over ``etp_group`` (fc2); ``split_out``: ``b``
    is (fc1); MAX all-reduces over ``etp_group`` only then."""

    @staticmethod
    def forward(ctx, x, w, recipe, split_in, split_out, etp_group):
        fwd = recipe.forward_dtype
        in_group = etp_group if split_in else None
        qx = _dequantised(x, recipe, fwd, in_group)
        qw = _dequantised(w.transpose(1, 2), recipe, fwd, in_group)   # [E, b, a] along a
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.out_group = recipe, etp_group if split_out else None
        return torch.bmm(qx, qw.transpose(1, 2)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg = _dequantised(grad, recipe, recipe.grad_dtype, ctx.out_group)    # along b
            qw = _dequantised(w, recipe, recipe.forward_dtype, ctx.out_group)    # [E, a, b]
            dx = torch.bmm(qg, qw.transpose(1, 2)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = x.transpose(1, 2).bmm(grad.to(x.dtype)).to(w.dtype)
        return dx, dw, None, None, None, None


def fp8_expert_bmm(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe, *, split_in: bool,
                   split_out: bool, etp_group) -> torch.Tensor:
    """``torch.bmm(x, w)`` of the grouped experts in fp8 (:class:`Fp8ExpertBmm`)."""
    return Fp8ExpertBmm.apply(x, w, recipe, split_in, split_out, etp_group)
