"""LayerNorm and RMSNorm, with apex's fused kernels when installed on CUDA."""

from __future__ import annotations

import importlib.util

import torch

from megalite.config import ConfigError
from megalite.layers.sharding import mark_param

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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
               device=None, dtype=None) -> torch.nn.Module:
    """A norm over the last dim of ``[s, b, h]``: ``kind`` is LayerNorm (weight and bias)
    or RMSNorm (weight). Weights start at one, biases at zero. Under sequence parallelism
    the parameters are marked ``sequence_parallel`` (their gradients are summed over tp).
    """
    if kind not in NORMALIZATIONS:
        raise ConfigError(f"unknown normalization {kind!r}; choose one of {NORMALIZATIONS}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    fused = _apex_norm(kind) if device.type == "cuda" else None
    if fused is not None:
        norm = fused(hidden_size, eps=eps).to(device=device, dtype=dtype)
    elif kind == "LayerNorm":
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=dtype)
    else:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, device=device, dtype=dtype)
    mark_param(norm.weight, init_fill=1.0, sequence_parallel=sequence_parallel)
    if getattr(norm, "bias", None) is not None:
        mark_param(norm.bias, init_fill=0.0, sequence_parallel=sequence_parallel)
    return norm
