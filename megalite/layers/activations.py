"""The MLP activations, shared by the dense MLP (:mod:`megalite.transformer.mlp`) and the
experts of an MoE layer (:mod:`megalite.moe.experts`, :mod:`megalite.moe.layer`).

:func:`swiglu` is ``silu(gate) * up`` on the fused ``[gate; up]`` projection: eagerly one
autograd function (:class:`_SwiGLU`: one output allocation, the gradient of both halves
written into one ``[.., 2 ffn]`` tensor instead of concatenated), under ``torch.compile``
the plain expression that inductor fuses. Both give the plain formula's values bit for bit.
No collective: each rank applies it to its own columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        gate, up = y.chunk(2, dim=-1)
        ctx.save_for_backward(y)          # silu(gate) is computed again in backward
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        # d up = grad silu(gate); d gate = silu'(gate) (grad up): the same ops autograd
        # runs for silu(gate) * up, written into the halves of one gradient tensor
        (y,) = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        act = F.silu(gate)
        dy = torch.empty(y.shape, dtype=grad.dtype, device=grad.device)
        d_gate, d_up = dy.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        torch.mul(grad, act, out=d_up)
        return dy


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``[..., 2 f]`` (``[gate; up]``) -> ``silu(gate) * up`` ``[..., f]``."""
    if torch.compiler.is_compiling() or not y.requires_grad:
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(y)


def activation(x: torch.Tensor, use_swiglu: bool) -> torch.Tensor:
    """With ``use_swiglu`` (``--swiglu``): ``[..., 2 f]`` (``[gate | up]``) -> :func:`swiglu`
    ``[..., f]``; else GeLU, same shape."""
    if use_swiglu:
        return swiglu(x)
    return F.gelu(x)
