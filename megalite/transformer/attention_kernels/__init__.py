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


def select_attention_backend(requested: str, device, dtype: torch.dtype,
                             same_head_dims: bool = True) -> str:
    """Resolve ``auto`` and Megatron's names (``fused``, ``unfused``) to a kernel of
    ``KERNELS`` and check that it can run on ``device`` in ``dtype`` (and, when
    ``same_head_dims`` is False, with a value head dim other than the query/key one);
    raises :class:`ConfigError` naming the alternatives when it cannot."""
    requested = MEGATRON_ALIASES.get(requested, requested)
    if requested == "auto":
        usable = (FlashAttention.unavailable(device, dtype) is None
                  and (same_head_dims or not FlashAttention.needs_same_head_dims))
        return "flash" if usable else "sdpa"
    if requested not in KERNELS:
        raise ConfigError(f"unknown attention backend {requested!r}; choose auto or one of "
                          f"{', '.join(KERNELS)}")
    reason = KERNELS[requested].unavailable(device, dtype)
    if reason is None and not same_head_dims and KERNELS[requested].needs_same_head_dims:
        reason = ("value heads as wide as query/key heads (multi-latent attention's "
                  "--v-head-dim differs from --qk-head-dim + --qk-pos-emb-head-dim)")
    if reason is not None:
        others = ", ".join(["auto", *(k for k in KERNELS if k != requested)])
        raise ConfigError(f"--attention-backend {requested} needs {reason}; use {others}")
    return requested


def build_core_attention(cfg, ps, rng, *, device=None, dtype=None,
                         qk_head_dim: int | None = None,
                         v_head_dim: int | None = None) -> CoreAttention:
    """The attention kernel for model config ``cfg`` on this rank of ``ps``.

    ``rng`` is the model's dropout :class:`~megalite.parallel.random.RNGTracker`;
    ``qk_head_dim`` / ``v_head_dim``: the head dims when they may differ (multi-latent
    attention), for the kernels that need them equal.
    """
    device = ps.device if device is None else device
    name = select_attention_backend(cfg.attention_backend, device, dtype or torch.float32,
                                    same_head_dims=qk_head_dim == v_head_dim)
    kernel = KERNELS[name](cfg.attention_dropout, rng)
    if ps.cp.size > 1:
        from megalite.transformer.attention_kernels.context_parallel import (
            build_context_parallel_attention,
        )

        kernel = build_context_parallel_attention(kernel, cfg.cp_comm_type, ps)
    return kernel
