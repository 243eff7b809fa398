"""Causal self-attention: MHA and grouped-query attention, tensor-parallel over heads.

Each TP rank holds ``heads/tp`` query heads and ``groups/tp`` key/value groups: the fused
QKV projection is column-parallel with parts ``[Q; K; V]`` (see ``layers.sharding``), the
output projection row-parallel. The attention kernel itself (``--attention-backend``:
local, sdpa, flash, auto) sits behind the seam in :mod:`megalite.transformer.attention_kernels`;
under context parallelism it is the cp wrapper of ``--cp-comm-type``, which gets this rank's
load-balanced chunks of q, k, v (``megalite.parallel.cp_chunks``) and exchanges keys/values
over ``ps.cp``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.transformer.attention_kernels import (  # noqa: F401  (re-exported)
    CoreAttention,
    build_core_attention,
    select_attention_backend,
)
from megalite.transformer.max_logits import MaxLogitTracker
from megalite.transformer.norms import build_norm
from megalite.transformer.rope import apply_rotary


class SelfAttention(torch.nn.Module):
    """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape.

    ``ps`` is the ParallelState (heads are split over ``ps.tp``); ``rotary`` is the
    ``(cos, sin)`` pair from :class:`RotaryEmbedding` or None. ``recompute_core``
    checkpoints the attention kernel (selective recomputation). The head counts must
    divide over tp (``ModelConfig.check_layout``, checked once by the model).

    ``--qk-layernorm`` (Megatron-Core's ``q_layernorm`` / ``k_layernorm``): queries and
    keys are normalized per head over ``d`` (``--normalization``) before RoPE; the two
    weights ``[d]`` are replicated and, since each tp rank sees only its own heads, marked
    ``sequence_parallel`` so that their gradients are summed over ``ps.tp``.

    ``--qk-clip`` / ``--log-max-attention-logit``: ``max_logits`` (a
    :class:`~megalite.transformer.max_logits.MaxLogitTracker`) records each local head's
    largest logit of the training forwards; :meth:`qk_clip_scales` gives the row scales
    of the fused QKV projection that clip them.
    """

    def __init__(self, cfg, ps, *, sequence_parallel: bool, rng, output_std: float,
                 recompute_core: bool = False, fp8=None, device=None, dtype=None):
        super().__init__()
        tp = ps.tp.size
        nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
        self.local_heads, self.local_groups, self.head_dim = nh // tp, ng // tp, d
        self.rng = rng
        self.recompute_core = recompute_core
        kw = {"ps": ps, "sequence_parallel": sequence_parallel, "device": device,
              "dtype": dtype, "fp8": fp8}
        self.linear_qkv = ColumnParallelLinear(
            cfg.hidden_size, (nh + 2 * ng) * d, parts=(nh * d, ng * d, ng * d),
            bias=cfg.add_bias_linear or cfg.add_qkv_bias, init_std=cfg.init_method_std, **kw)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # shared by the heads of every tp rank: gradients summed over tp
            norm = dict(sequence_parallel=True, zero_centered=cfg.apply_layernorm_1p,
                        device=device, dtype=dtype)
            self.q_layernorm = build_norm(cfg.normalization, d, cfg.norm_epsilon, **norm)
            self.k_layernorm = build_norm(cfg.normalization, d, cfg.norm_epsilon, **norm)
        self.core_attention = build_core_attention(cfg, ps, rng, device=device, dtype=dtype)
        self.linear_proj = RowParallelLinear(nh * d, cfg.hidden_size, bias=cfg.add_bias_linear,
                                             input_is_parallel=True, init_std=output_std, **kw)
        self.max_logits = (MaxLogitTracker(ps.cp)
                           if cfg.qk_clip or cfg.log_max_attention_logit else None)

    def qk_clip_scales(self, eta: torch.Tensor, alpha: float) -> dict:
        """QK-clip's factors for this rank's heads: ``eta`` ``[nh/tp]`` is ``min(1, tau /
        max logit)`` per local query head. As Megatron-Core does under grouped-query
        attention, a query group takes its heads' smallest ``eta`` (its largest logit):
        its query heads' rows of ``linear_qkv`` are scaled by ``eta ** alpha``, its key
        rows by ``eta ** (1 - alpha)``, the value rows not at all. Returns ``{parameter:
        factor}`` with a factor ``[rows, 1]`` for the weight and ``[rows]`` for the bias
        (scaled too, unlike Megatron-Core, so that the logits scale exactly)."""
        nh, ng, d = self.local_heads, self.local_groups, self.head_dim
        group = eta.view(ng, nh // ng).amin(dim=1)                    # [ng]
        rows = torch.cat([(group ** alpha).repeat_interleave(d * nh // ng),
                          (group ** (1.0 - alpha)).repeat_interleave(d),
                          torch.ones(ng * d, dtype=eta.dtype, device=eta.device)])
        out = {self.linear_qkv.weight: rows.unsqueeze(1)}
        if self.linear_qkv.bias is not None:
            out[self.linear_qkv.bias] = rows
        return out

    def forward(self, x: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                document_ids: torch.Tensor | None = None,
                kv_cache=None) -> torch.Tensor:
        """``document_ids`` ``[b, s]`` (whole sequence, also under context parallelism):
        each token attends only to earlier tokens of its own document.

        ``kv_cache`` (inference only): this layer's
        :class:`~megalite.inference.kv_cache.LayerKVCache`; the new keys/values are
        appended to it and the queries attend to all cached ones."""
        qkv = self.linear_qkv(x)  # [s, b, (nh + 2 ng) d / tp]
        s, b = qkv.shape[:2]
        nh, ng, d = self.local_heads, self.local_groups, self.head_dim
        qk, v = qkv.split([(nh + ng) * d, ng * d], dim=-1)  # backward: one cat, no zeros
        qk, v = qk.view(s, b, nh + ng, d), v.view(s, b, ng, d)
        if self.q_layernorm is not None:  # --qk-layernorm: per head, before RoPE
            q, k = qk.split([nh, ng], dim=2)
            qk = torch.cat([self.q_layernorm(q), self.k_layernorm(k)], dim=2)
        if rotary is not None:  # one kernel for q and k together
            qk = apply_rotary(qk, *rotary)
        q, k = qk.split([nh, ng], dim=2)
        if self.max_logits is not None and self.training and kv_cache is None:
            self.max_logits.observe(q, k, document_ids)   # no gradient, output untouched
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
            return self.linear_proj(kv_cache.attend(q, k, v))
        if self.recompute_core and self.training and torch.is_grad_enabled():
            ctx = checkpoint(self.core_attention, q, k, v, document_ids, use_reentrant=False,
                             context_fn=self.rng.recompute_context_fn)
        else:
            ctx = self.core_attention(q, k, v, document_ids)  # [s, b, nh d]
        return self.linear_proj(ctx)
