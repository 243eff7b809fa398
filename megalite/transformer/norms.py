"""LayerNorm and RMSNorm, with apex's fused kernels when installed on CUDA, and their
zero-centred ("1p") variants.

A 1p norm (``--apply-layernorm-1p``) stores its weight ``w`` centred on zero (initialised
at 0) and scales by ``1 + w``: the same function as a plain norm with weight ``w + 1``.
Norm weights get no weight decay either way (``optim.optimizer.uses_weight_decay``, as in
Megatron). The parameters keep the names ``weight`` and ``bias``; the Hugging Face
converters add or subtract the one (``megalite.models.families``). The 1p norms always
run PyTorch's kernels (apex's fused classes take a plain weight), so they bypass apex.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megalite.config import ConfigError
from megalite.layers.sharding import mark_param

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class LayerNorm1p(torch.nn.LayerNorm):
    """LayerNorm over the last dim of ``[..., h]`` scaling by ``1 + weight``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class RMSNorm1p(torch.nn.RMSNorm):
    """RMSNorm over the last dim of ``[..., h]`` scaling by ``1 + weight``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


def _apex_norm(kind: str):
    """apex's fused class for ``kind``, or None (imported lazily, only when present)."""
    if importlib.util.find_spec("apex") is None:
        return None
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError:
        return None
    return FusedLayerNorm if kind == "LayerNorm" else FusedRMSNorm


def build_norm(kind: str, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
               zero_centered: bool = False, device=None, dtype=None) -> torch.nn.Module:
    """A norm over the last dim of ``[s, b, h]``: ``kind`` is LayerNorm (weight and bias)
    or RMSNorm (weight). Weights start at one (at zero with ``zero_centered``, which
    applies ``1 + weight``), biases at zero. Under sequence parallelism the parameters are
    marked ``sequence_parallel`` (their gradients are summed over tp).
    """
    if kind not in NORMALIZATIONS:
        raise ConfigError(f"unknown normalization {kind!r}; choose one of {NORMALIZATIONS}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    fused = _apex_norm(kind) if device.type == "cuda" and not zero_centered else None
    if fused is not None:
        norm = fused(hidden_size, eps=eps).to(device=device, dtype=dtype)
    else:
        if kind == "LayerNorm":
            cls = LayerNorm1p if zero_centered else torch.nn.LayerNorm
        else:
            cls = RMSNorm1p if zero_centered else torch.nn.RMSNorm
        norm = cls(hidden_size, eps=eps, device=device, dtype=dtype)
    mark_param(norm.weight, init_fill=0.0 if zero_centered else 1.0,
               sequence_parallel=sequence_parallel)
    if getattr(norm, "bias", None) is not None:
        mark_param(norm.bias, init_fill=0.0, sequence_parallel=sequence_parallel)
    return norm
