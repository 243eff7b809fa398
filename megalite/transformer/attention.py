"""Causal self-attention: MHA and grouped-query attention, tensor-parallel over heads.

Each TP rank holds ``heads/tp`` query heads and ``groups/tp`` key/value groups: the fused
QKV projection is column-parallel with parts ``[Q; K; V]`` (see ``layers.sharding``), the
output projection row-parallel. The attention kernel (the *backend*) is chosen at run time:

``flash``  flash-attn's ``flash_attn_func`` (CUDA, fp16/bf16; imported lazily)
``sdpa``   ``torch.nn.functional.scaled_dot_product_attention``
``local``  explicit fp32 softmax; the readable reference
``auto``   flash when installed and usable, else sdpa
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.config import ConfigError
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.parallel.random import TENSOR_PARALLEL
from megalite.transformer.rope import apply_rotary


def select_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Resolve ``auto`` and check that the requested backend can run here."""
    flash_ok = (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                and importlib.util.find_spec("flash_attn") is not None)
    if requested == "auto":
        return "flash" if flash_ok else "sdpa"
    if requested == "flash" and not flash_ok:
        raise ConfigError("--attention-backend flash needs flash-attn installed, a CUDA "
                          "device and --bf16/--fp16; use auto, sdpa or local")
    if requested not in ("flash", "sdpa", "local"):
        raise ConfigError(f"unknown attention backend {requested!r}")
    return requested


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with dropout on the probabilities.

    q ``[s, b, nh, d]``, k and v ``[s, b, ng, d]`` (``nh`` a multiple of ``ng``: each group
    of ``nh/ng`` consecutive query heads shares one key/value head) -> ``[s, b, nh * d]``.
    Dropout draws from the tracker's tensor-parallel stream (heads differ per TP rank).
    """

    def __init__(self, backend: str, dropout: float, rng):
        super().__init__()
        self.backend = backend
        self.dropout = dropout
        self.rng = rng

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        if p > 0.0:
            with self.rng.fork(TENSOR_PARALLEL):
                return self._attend(q, k, v, p)
        return self._attend(q, k, v, p)

    def _attend(self, q, k, v, p):
        s, b, nh, d = q.shape
        if self.backend == "flash":
            from flash_attn import flash_attn_func

            out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  dropout_p=p, causal=True)  # [b, s, nh, d]
            return out.transpose(0, 1).reshape(s, b, nh * d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.backend == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                 enable_gqa=k.shape[1] != nh)
        else:
            out = _local_attention(q, k, v, p)
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)


def _local_attention(q, k, v, p):
    """Reference kernel on ``[b, heads, s, d]``: explicit scores, fp32 softmax."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    if p > 0.0:
        probs = F.dropout(probs, p)
    return torch.matmul(probs.to(v.dtype), v)


class SelfAttention(torch.nn.Module):
    """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape.

    ``rotary`` is the ``(cos, sin)`` pair from :class:`RotaryEmbedding` or None.
    ``recompute_core`` checkpoints the attention kernel (selective recomputation).
    """

    def __init__(self, cfg, *, tp_group, sequence_parallel: bool, rng, output_std: float,
                 recompute_core: bool = False, device=None, dtype=None):
        super().__init__()
        tp = tp_group.size
        nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        for what, n in (("num_attention_heads", nh), ("num_query_groups", ng)):
            if n % tp:
                raise ConfigError(f"{what} ({n}) must be divisible by "
                                  f"tensor_model_parallel_size ({tp})")
        self.local_heads, self.local_groups, self.head_dim = nh // tp, ng // tp, d
        self.rng = rng
        self.recompute_core = recompute_core
        kw = {"tp_group": tp_group, "sequence_parallel": sequence_parallel, "device": device,
                  "dtype": dtype}
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size, (nh + 2 * ng) * d, parts=(nh * d, ng * d, ng * d),
            bias=cfg.add_bias_linear or cfg.add_qkv_bias, init_std=cfg.init_method_std, **kw)
        backend = select_attention_backend(cfg.attention_backend, device or "cpu",
                                           dtype or torch.float32)
        self.core_attention = CoreAttention(backend, cfg.attention_dropout, rng)
        self.linear_proj = RowParallelLinear(nh * d, cfg.hidden_size, bias=cfg.add_bias_linear,
                                             input_is_parallel=True, init_std=output_std, **kw)

    def forward(self, x: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [s, b, (nh + 2 ng) d / tp]
        s, b = qkv.shape[:2]
        nh, ng, d = self.local_heads, self.local_groups, self.head_dim
        qk = qkv[..., :(nh + ng) * d].view(s, b, nh + ng, d)
        v = qkv[..., (nh + ng) * d:].view(s, b, ng, d)
        if rotary is not None:  # one kernel for q and k together
            qk = apply_rotary(qk, *rotary)
        q, k = qk.split([nh, ng], dim=2)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self.core_attention, q, k, v, use_reentrant=False,
                             context_fn=self.rng.recompute_context_fn)
        else:
            ctx = self.core_attention(q, k, v)  # [s, b, nh d]
        return self.linear_proj(ctx)
