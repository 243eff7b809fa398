"""Attention kernels behind one seam: ``softmax(q k^T / sqrt(d) + causal) v``.

A kernel is a :class:`~megalite.transformer.attention_kernels.base.CoreAttention` subclass
in a file of its own, registered here by name. :func:`build_core_attention` is the one
place that turns the config (``--attention-backend``) into a kernel, so a new kernel (or a
context-parallel attention that wraps one) is one file and one line in ``KERNELS``:

=========  ===========================================================================
``local``  explicit scores and an fp32 softmax; the readable reference
``sdpa``   ``torch.nn.functional.scaled_dot_product_attention``
``flash``  flash-attn's ``flash_attn_func`` (CUDA, fp16/bf16; imported lazily)
``auto``   flash when installed and usable here, else sdpa
=========  ===========================================================================

With ``--context-parallel-size`` > 1 the kernel is wrapped by the context-parallel
attention of ``--cp-comm-type`` (``context_parallel/``: p2p ring, allgather, a2a).

Megatron's ``AttnBackend`` names are accepted too (``MEGATRON_ALIASES``): ``fused`` is
sdpa (a fused kernel) and ``unfused`` is local (explicit scores and softmax).
"""

from __future__ import annotations

import torch

from megalite.config import ConfigError
from megalite.transformer.attention_kernels.base import CoreAttention
from megalite.transformer.attention_kernels.flash import FlashAttention
from megalite.transformer.attention_kernels.local import LocalAttention
from megalite.transformer.attention_kernels.sdpa import SdpaAttention

KERNELS: dict[str, type[CoreAttention]] = {
    "local": LocalAttention,
    "sdpa": SdpaAttention,
    "flash": FlashAttention,
}

MEGATRON_ALIASES: dict[str, str] = {"fused": "sdpa", "unfused": "local"}

__all__ = ["KERNELS", "MEGATRON_ALIASES", "CoreAttention", "build_core_attention",
           "select_attention_backend"]


def select_attention_backend(requested: str, device, dtype: torch.dtype) -> str:
    """Resolve ``auto`` and Megatron's names (``fused``, ``unfused``) to a kernel of
    ``KERNELS`` and check that it can run on ``device`` in ``dtype``; raises
    :class:`ConfigError` naming the alternatives when it cannot."""
    requested = MEGATRON_ALIASES.get(requested, requested)
    if requested == "auto":
        return "flash" if FlashAttention.unavailable(device, dtype) is None else "sdpa"
    if requested not in KERNELS:
        raise ConfigError(f"unknown attention backend {requested!r}; choose auto or one of "
                          f"{', '.join(KERNELS)}")
    reason = KERNELS[requested].unavailable(device, dtype)
    if reason is not None:
        others = ", ".join(["auto", *(k for k in KERNELS if k != requested)])
        raise ConfigError(f"--attention-backend {requested} needs {reason}; use {others}")
    return requested


def build_core_attention(cfg, ps, rng, *, device=None, dtype=None) -> CoreAttention:
    """The attention kernel for model config ``cfg`` on this rank of ``ps``.

    ``rng`` is the model's dropout :class:`~megalite.parallel.random.RNGTracker`.
    """
    device = ps.device if device is None else device
    name = select_attention_backend(cfg.attention_backend, device, dtype or torch.float32)
    kernel = KERNELS[name](cfg.attention_dropout, rng)
    if ps.cp.size > 1:
        from megalite.transformer.attention_kernels.context_parallel import (
            build_context_parallel_attention,
        )

        kernel = build_context_parallel_attention(kernel, cfg.cp_comm_type, ps)
    return kernel
