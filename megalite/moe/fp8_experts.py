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

Activations and output gradients are quantised per micro-batch; each expert weight once
per training step for the forward and once for the input gradient
(:class:`Fp8ExpertWeights`, held by the :class:`~megalite.moe.experts.GroupedMLP`), as a
dense linear's (:class:`~megalite.layers.fp8.scaling.StepWeights`); evaluation quantises
afresh.
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
from megalite.layers.fp8.scaling import StepWeights
from megalite.parallel import collectives as C
from megalite.parallel.collectives import ReduceOp


def _quantised(x: torch.Tensor, recipe: Fp8Recipe, dtype: torch.dtype, group
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` quantised along K: (fp8 values ``[..., K]``, scales): per row
    (``[..., 1]`` fp32, the row's amax, a MAX over ``group`` when K is split over it;
    ``group`` None: K is whole) or per block (``[..., K / block]``)."""
    if recipe.block is not None:
        return block_quantize(x, recipe.block, dtype, mx=recipe.recipe == "mxfp8")
    amax = x.detach().abs().amax(-1, keepdim=True).float().contiguous()
    if group is not None:
        C.all_reduce(amax, group, ReduceOp.MAX)
    d = dequant_scale(amax, dtype, recipe.margin)
    return quantize(x, d, dtype), d


def _dequantise(q: torch.Tensor, scales: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """fp32 values of :func:`_quantised`'s output, ``[..., K]``."""
    if recipe.block is not None:
        return block_dequantize(q, scales)
    return q.float() * scales


def _dequantised(x: torch.Tensor, recipe: Fp8Recipe, dtype: torch.dtype, group
                 ) -> torch.Tensor:
    """``x`` ``[..., K]`` quantised along K and back, fp32 (:func:`_quantised`)."""
    return _dequantise(*_quantised(x, recipe, dtype, group), recipe)


class Fp8ExpertWeights(StepWeights):
    """The step's quantised expert weights of one :class:`~megalite.moe.experts.GroupedMLP`
    (:class:`~megalite.layers.fp8.scaling.StepWeights`): for each weight ``w``
    ``[E, a, b]`` (``"fc1"``, ``"fc2"``), ``w^T`` quantised along ``a`` (the forward's
    operand, ``[E, b, a]``, made at the step's first training forward) and ``w`` along
    ``b`` (the input gradient's, ``[E, a, b]``, at its first backward), values in the
    forward's fp8 dtype with their scales, reused by every later micro-batch and
    recomputed forward of the step and forgotten by
    :func:`~megalite.layers.fp8.scaling.finish_step` before the optimizer changes the
    weights; outside training made at every call and not kept. The weights' scales are
    current (per output channel or block), so there is no amax to record on a reuse."""

    def quantised(self, name: str, transposed: bool, w: torch.Tensor, recipe: Fp8Recipe,
                  group) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, scales) of ``w.transpose(1, 2)`` (``transposed``, along ``a``) or ``w``
        (along ``b``), row amaxes reduced over ``group`` (split contraction; the
        collective runs only when the copy is made)."""
        return self.step_copy((name, transposed), self.training,
                              lambda: _weight_quantised(w, transposed, recipe, group))


class Fp8ExpertBmm(torch.autograd.Function):
    """``x`` ``[E, C, a]`` @ ``w`` ``[E, a, b]`` -> ``[E, C, b]`` in ``x``'s dtype, forward
    and input gradient in fp8 (module docstring), the weight gradient in the training
    precision. ``split_in``: ``a`` is split over ``etp_group`` (fc2); ``split_out``: ``b``
    is (fc1); MAX all-reduces over ``etp_group`` only then."""

    @staticmethod
    def forward(ctx, x, w, recipe, split_in, split_out, etp_group, weights, name):
        fwd = recipe.forward_dtype
        in_group = etp_group if split_in else None
        qx = _dequantised(x, recipe, fwd, in_group)
        # w^T [E, b, a] along a: once per training step with ``weights``
        qw = _dequantise(*_weight(weights, name, True, w, recipe, in_group), recipe)
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.out_group = recipe, etp_group if split_out else None
        ctx.weights, ctx.name = weights, name
        return torch.bmm(qx, qw.transpose(1, 2)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        recipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg = _dequantised(grad, recipe, recipe.grad_dtype, ctx.out_group)    # along b
            qw = _dequantise(*_weight(ctx.weights, ctx.name, False, w, recipe,   # [E, a, b]
                                      ctx.out_group), recipe)
            dx = torch.bmm(qg, qw.transpose(1, 2)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = x.transpose(1, 2).bmm(grad.to(x.dtype)).to(w.dtype)
        return dx, dw, None, None, None, None, None, None


def _weight_quantised(w: torch.Tensor, transposed: bool, recipe: Fp8Recipe, group
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) of ``w`` ``[E, a, b]`` in the forward's fp8 dtype: ``w^T`` along
    ``a`` (``transposed``) or ``w`` along ``b`` (:func:`_quantised`)."""
    return _quantised(w.transpose(1, 2) if transposed else w, recipe, recipe.forward_dtype,
                      group)


def _weight(weights: Fp8ExpertWeights | None, name: str, transposed: bool, w, recipe, group):
    """The quantised weight from the step's ``weights``, or made now without them."""
    if weights is None:
        return _weight_quantised(w, transposed, recipe, group)
    return weights.quantised(name, transposed, w, recipe, group)


def fp8_expert_bmm(x: torch.Tensor, w: torch.Tensor, recipe: Fp8Recipe, *, split_in: bool,
                   split_out: bool, etp_group, weights: Fp8ExpertWeights | None = None,
                   name: str = "") -> torch.Tensor:
    """``torch.bmm(x, w)`` of the grouped experts in fp8 (:class:`Fp8ExpertBmm`); with
    ``weights`` the weight ``name``'s quantisations are kept for the training step."""
    return Fp8ExpertBmm.apply(x, w, recipe, split_in, split_out, etp_group, weights, name)
