"""The feed-forward block: GeLU or SwiGLU (:mod:`megalite.layers.activations`),
column-parallel up, row-parallel down."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megalite.layers.activations import activation
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear


class MLP(torch.nn.Module):
    """``[s, b, h]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

    GeLU: ``fc2(gelu(fc1(x)))`` with fc1 ``[ffn/tp, h]`` per rank. SwiGLU (``cfg.swiglu``):
    fc1 fuses ``[gate; up]`` (``[2 ffn/tp, h]`` per rank, each half sharded separately) and
    ``fc2(silu(gate) * up)``. fc2 is row-parallel ``[h, ffn/tp]``; both over ``ps.tp``.
    ``recompute`` (``--recompute-modules mlp``): checkpointed in training, only its input
    kept (it draws no random numbers).
    """

    def __init__(self, cfg, ps, *, sequence_parallel: bool, output_std: float,
                 recompute: bool = False, fp8=None, device=None, dtype=None):
        super().__init__()
        ffn = cfg.ffn_hidden_size
        self.swiglu = cfg.swiglu
        self.recompute = recompute
        kw = {"ps": ps, "sequence_parallel": sequence_parallel, "device": device,
              "dtype": dtype, "bias": cfg.add_bias_linear, "fp8": fp8}
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, 2 * ffn if cfg.swiglu else ffn,
            parts=(ffn, ffn) if cfg.swiglu else None, init_std=cfg.init_method_std, **kw)
        self.linear_fc2 = RowParallelLinear(ffn, cfg.hidden_size, input_is_parallel=True,
                                            init_std=output_std, **kw)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.linear_fc1(x), self.swiglu))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

