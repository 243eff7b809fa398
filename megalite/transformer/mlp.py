"""The feed-forward block: GeLU or SwiGLU, column-parallel up, row-parallel down.

:func:`swiglu` is ``silu(gate) * up`` on the fused ``[gate; up]`` projection: eagerly one
autograd function (:class:`_SwiGLU`: one output allocation, the gradient of both halves
written into one ``[.., 2 ffn]`` tensor instead of concatenated), under ``torch.compile``
the plain expression that inductor fuses. Both give the plain formula's values bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """``[s, b, h]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

    GeLU: ``fc2(gelu(fc1(x)))`` with fc1 ``[ffn/tp, h]`` per rank. SwiGLU (``cfg.swiglu``):
    fc1 fuses ``[gate; up]`` (``[2 ffn/tp, h]`` per rank, each half sharded separately) and
    ``fc2(silu(gate) * up)``. fc2 is row-parallel ``[h, ffn/tp]``; both over ``ps.tp``.
    """

    def __init__(self, cfg, ps, *, sequence_parallel: bool, output_std: float,
                 device=None, dtype=None):
        super().__init__()
        ffn = cfg.ffn_hidden_size
        self.swiglu = cfg.swiglu
        kw = {"ps": ps, "sequence_parallel": sequence_parallel, "device": device,
              "dtype": dtype, "bias": cfg.add_bias_linear}
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, 2 * ffn if cfg.swiglu else ffn,
            parts=(ffn, ffn) if cfg.swiglu else None, init_std=cfg.init_method_std, **kw)
        self.linear_fc2 = RowParallelLinear(ffn, cfg.hidden_size, input_is_parallel=True,
                                            init_std=output_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            y = swiglu(y)
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


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
