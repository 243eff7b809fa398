"""Multi-latent attention (DeepSeek-V2/V3; ``--multi-latent-attention``), tensor-parallel
over heads, with Megatron-Core's parameter names and layout.

With ``n`` heads, ``dq = qk_head_dim``, ``dr = qk_pos_emb_head_dim``, ``dv = v_head_dim``:

* queries: ``linear_q_down_proj`` ``[q_lora_rank, h]`` -> ``q_layernorm`` ->
  ``linear_q_up_proj`` ``[n (dq + dr), q_lora_rank]``; without ``--q-lora-rank`` one
  ``linear_q_proj`` ``[n (dq + dr), h]``. Head ``i`` is rows ``[i (dq+dr), (i+1) (dq+dr))``:
  its ``dq`` channels without position, then its ``dr`` RoPE channels.
* keys/values: ``linear_kv_down_proj`` ``[kv_lora_rank + dr, h]`` gives the latent
  (``kv_layernorm``, then ``linear_kv_up_proj`` ``[n (dq + dv), kv_lora_rank]``: per head
  ``dq`` key channels then ``dv`` value channels) and ``dr`` RoPE channels of one key
  shared by every head.
* RoPE on the ``dr`` channels of queries and the shared key, in DeepSeek's interleaved
  pairs ``(x0, x1), (x2, x3), ...`` (rotated as Megatron-Core does: de-interleaved to halves,
  then the rotate-half formula, so the result is laid out in halves -- the same for q and
  k, which is all a dot product sees), with YaRN's frequencies and cos/sin scale
  (:mod:`megalite.transformer.yarn`, passed in as ``rotary``).
* attention over query/key heads of ``dq + dr`` and value heads of ``dv`` with the softmax
  scale ``mscale(factor, mscale_all_dim)^2 / sqrt(dq + dr)``: the queries are multiplied
  by the ``mscale^2`` factor, so every kernel keeps its ``1/sqrt(d)``.
* inference (a ``kv_cache``): the cache holds the normalised kv latent and the roped
  shared key, ``kv_lora_rank + dr`` values per token and layer; decoding steps attend with
  ``linear_kv_up_proj`` absorbed into the queries and the output
  (:meth:`MLASelfAttention._absorbed`).
* ``linear_proj`` ``[h, n dv]`` row-parallel. Only ``linear_proj`` has a bias (with
  ``--add-bias-linear``), as in Megatron-Core.

The norms exist with ``--qk-layernorm`` (Megatron-Core's rule; DeepSeek-V3 always has
them). Hugging Face's ``DeepseekV3Attention`` names, one to one with the same tensors:
``q_a_proj`` = ``linear_q_down_proj``, ``q_a_layernorm`` = ``q_layernorm``, ``q_b_proj`` =
``linear_q_up_proj``, ``q_proj`` = ``linear_q_proj``, ``kv_a_proj_with_mqa`` =
``linear_kv_down_proj``, ``kv_a_layernorm`` = ``kv_layernorm``, ``kv_b_proj`` =
``linear_kv_up_proj``, ``o_proj`` = ``linear_proj``.

Tensor parallelism (``ps.tp``): the up projections are column-parallel (``n/tp`` heads per
rank, contiguous rows), ``linear_proj`` row-parallel; the down projections and the latent
norms are replicated. Under sequence parallelism the down projections and norms run on
this rank's ``[s/tp, b, h]`` tokens (their weight gradients are partial: marked
``sequence_parallel``, summed over tp), the up projections all-gather their input, and the
shared RoPE key is all-gathered over tp (reduce-scatter in backward). Without sequence
parallelism the shared key's gradient, which each rank computes for its own heads only, is
summed over tp (``copy_to_tensor_model_parallel_region``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.parallel import mappings
from megalite.parallel.params import mark_param
from megalite.transformer.attention_kernels import build_core_attention
from megalite.transformer.max_logits import MaxLogitTracker
from megalite.transformer.norms import build_norm
from megalite.transformer.rope import apply_rotary
from megalite.transformer.yarn import softmax_scale_factor


class ReplicatedLinear(torch.nn.Module):
    """``[..., in]`` -> ``[..., out]`` with the whole weight ``[out, in]`` on every tp rank
    and no communication. ``sequence_parallel``: the input is this rank's share of the
    sequence, so the weight gradient is partial (summed over tp by the optimizer)."""

    def __init__(self, input_size: int, output_size: int, *, ps, sequence_parallel: bool,
                 init_std: float, device=None, dtype=None):
        super().__init__()
        device = ps.device if device is None else device
        self.weight = mark_param(
            torch.nn.Parameter(torch.empty(output_size, input_size, device=device,
                                           dtype=dtype)),
            init_std=init_std, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[s, b, heads, d]`` whose channels pair up as ``(2i, 2i+1)``: the pairs
    are de-interleaved to halves and rotated by :func:`apply_rotary` (result in halves)."""
    halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return apply_rotary(halves, cos, sin)


class MLASelfAttention(torch.nn.Module):
    """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape; see the
    module docstring. ``rotary``: ``(cos, sin)`` ``[s, b|1, 1, qk_pos_emb_head_dim]`` from
    :class:`~megalite.transformer.yarn.YarnRotaryEmbedding` (required).
    ``cfg.recomputes("core_attn")`` checkpoints the kernel, ``"mla_up_proj"`` the up
    projections and RoPE (both: one checkpoint around the two)."""

    def __init__(self, cfg, ps, *, sequence_parallel: bool, rng, output_std: float,
                 fp8=None, device=None, dtype=None):
        super().__init__()
        tp = ps.tp.size
        self.tp_group = ps.tp
        self.sequence_parallel = sequence_parallel and tp > 1
        n = cfg.num_attention_heads
        self.local_heads = n // tp
        self.dq, self.dr, self.dv = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_scale = softmax_scale_factor(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
        self.recompute_core = cfg.recomputes("core_attn")
        self.recompute_up_proj = cfg.recomputes("mla_up_proj")
        self.rng = rng
        h, std, qk = cfg.hidden_size, cfg.init_method_std, self.dq + self.dr
        kw = {"ps": ps, "sequence_parallel": sequence_parallel, "device": device,
              "dtype": dtype}
        # fp8 (--fp8-format) runs the tp-split up and output projections' GEMMs; the
        # replicated down projections stay in the training precision
        tp_kw = {**kw, "fp8": fp8}
        norm = dict(sequence_parallel=self.sequence_parallel,
                    zero_centered=cfg.apply_layernorm_1p, device=device, dtype=dtype)
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, n * qk, bias=False, init_std=std,
                                                      **tp_kw)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, cfg.q_lora_rank, init_std=std, **kw)
            self.q_layernorm = (build_norm(cfg.normalization, cfg.q_lora_rank,
                                           cfg.norm_epsilon, **norm)
                                if cfg.qk_layernorm else None)
            self.linear_q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, n * qk, bias=False,
                                                         init_std=std, **tp_kw)
        self.linear_kv_down_proj = ReplicatedLinear(h, cfg.kv_lora_rank + self.dr,
                                                    init_std=std, **kw)
        self.kv_layernorm = (build_norm(cfg.normalization, cfg.kv_lora_rank, cfg.norm_epsilon,
                                        **norm) if cfg.qk_layernorm else None)
        self.linear_kv_up_proj = ColumnParallelLinear(cfg.kv_lora_rank,
                                                      n * (self.dq + self.dv), bias=False,
                                                      init_std=std, **tp_kw)
        self.core_attention = build_core_attention(cfg, ps, rng, device=device, dtype=dtype,
                                                   v_head_dim=self.dv, qk_head_dim=qk)
        self.linear_proj = RowParallelLinear(n * self.dv, h, bias=cfg.add_bias_linear,
                                             input_is_parallel=True, init_std=output_std,
                                             **tp_kw)
        self.max_logits = (MaxLogitTracker(ps.cp)
                           if cfg.qk_clip or cfg.log_max_attention_logit else None)

    def qk_clip_scales(self, eta: torch.Tensor, alpha: float) -> dict:
        """QK-clip's factors for this rank's heads (Kimi-K2's rule for MLA, as
        Megatron-Core applies it): ``eta`` ``[n/tp]`` is ``min(1, tau / max logit)`` per
        local head. In the query projection (``linear_q_proj``, or ``linear_q_up_proj``
        with ``--q-lora-rank``) a head's ``dq`` rows are scaled by ``eta ** alpha`` and its
        ``dr`` RoPE rows by ``eta``; in ``linear_kv_up_proj`` its ``dq`` key rows by ``eta
        ** (1 - alpha)`` and its value rows not at all. The RoPE key, shared by every head
        (in ``linear_kv_down_proj``), is not touched. Returns ``{parameter: [rows, 1]}``."""
        up = self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj
        q_rows = torch.cat([(eta ** alpha).unsqueeze(1).expand(-1, self.dq),
                            eta.unsqueeze(1).expand(-1, self.dr)], dim=1).reshape(-1)
        k_rows = torch.cat([(eta ** (1.0 - alpha)).unsqueeze(1).expand(-1, self.dq),
                            torch.ones_like(eta).unsqueeze(1).expand(-1, self.dv)],
                           dim=1).reshape(-1)
        return {up.weight: q_rows.unsqueeze(1), self.linear_kv_up_proj.weight:
                k_rows.unsqueeze(1)}

    def _latents(self, x: torch.Tensor):
        """Down projections and norms: (query latent or ``x``, kv latent, shared RoPE key
        ``[s, b, 1, dr]`` whole sequence)."""
        if self.q_lora_rank is None:
            q_latent = x
        else:
            q_latent = self.linear_q_down_proj(x)                  # [s(/tp), b, q_lora]
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
        kv, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.dr], dim=-1)
        if self.kv_layernorm is not None:
            kv = self.kv_layernorm(kv)
        if self.sequence_parallel:
            k_pe = mappings.gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = mappings.copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        return q_latent, kv, k_pe.unsqueeze(2)

    def _query(self, q_latent):
        """The queries' up projection, scaled by YaRN's softmax factor: (q_nope
        ``[s, b, n/tp, dq]``, q_pe ``[s, b, n/tp, dr]``)."""
        up = self.linear_q_proj if self.q_lora_rank is None else self.linear_q_up_proj
        q = up(q_latent)
        s, b = q.shape[:2]
        q = q.view(s, b, self.local_heads, self.dq + self.dr)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q.split([self.dq, self.dr], dim=-1)

    def _rope(self, q_pe, k_pe, cos, sin):
        """RoPE on the queries' positional part and on the shared key ``[s, b, 1, dr]``, in
        one call: (q_pe, k_pe)."""
        pe = rotate_interleaved(torch.cat([q_pe, k_pe], dim=2), cos, sin)
        return pe.split([self.local_heads, 1], dim=2)

    def _up_proj_and_rope(self, q_latent, kv_latent, k_pe, cos, sin):
        """(query ``[s, b, n/tp, dq+dr]``, key ``[s, b, n/tp, dq+dr]``, value
        ``[s, b, n/tp, dv]``)."""
        q_nope, q_pe = self._query(q_latent)
        s, b, nh = q_nope.shape[:3]
        kv = self.linear_kv_up_proj(kv_latent).view(s, b, nh, self.dq + self.dv)
        k_nope, v = kv.split([self.dq, self.dv], dim=-1)
        q_pe, k_pe = self._rope(q_pe, k_pe, cos, sin)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(s, b, nh, self.dr)], dim=-1)
        return query, key, v.contiguous()

    def _observe(self, q, k, document_ids) -> None:
        """``--qk-clip`` / ``--log-max-attention-logit``: this forward's logits per head
        (training only; no gradient, the output is not touched)."""
        if self.max_logits is not None and self.training:
            self.max_logits.observe(q, k, document_ids)

    def _attend(self, q_latent, kv_latent, k_pe, cos, sin, document_ids):
        q, k, v = self._up_proj_and_rope(q_latent, kv_latent, k_pe, cos, sin)
        self._observe(q, k, document_ids)
        return self.core_attention(q, k, v, document_ids)

    def _cached(self, kv_cache, q_latent, kv_latent, k_pe, cos, sin) -> torch.Tensor:
        """Context ``[s, b, n/tp * dv]`` of this step's queries over every cached token;
        stores this step's latent and roped shared key in ``kv_cache``."""
        if kv_cache.parent.seq_len == 0:   # the prompt: full keys and values, once
            q, k, v = self._up_proj_and_rope(q_latent, kv_latent, k_pe, cos, sin)
            kv_cache.append(kv_latent.unsqueeze(2), k[:, :, :1, self.dq:])
            return kv_cache.attend(q, k, v)
        q_nope, q_pe = self._query(q_latent)
        q_pe, k_pe = self._rope(q_pe, k_pe, cos, sin)
        latent, k_rope = kv_cache.append(kv_latent.unsqueeze(2), k_pe)
        return self._absorbed(q_nope, q_pe, latent[:, :, 0], k_rope[:, :, 0], kv_cache)

    def _absorbed(self, q_nope, q_pe, latent, k_pe, kv_cache) -> torch.Tensor:
        """Attention with the up projections absorbed: queries ``q_nope`` ``[s, b, n/tp,
        dq]`` (scaled and) ``q_pe`` ``[s, b, n/tp, dr]`` (roped) over the latent ``[S, b,
        kv_lora_rank]`` and the roped shared key ``[S, b, dr]`` -> ``[s, b, n/tp * dv]``.
        Head ``i``'s ``W_UK`` ``[dq, kv_lora_rank]`` / ``W_UV`` ``[dv, kv_lora_rank]`` are
        its rows of this rank's ``linear_kv_up_proj``: ``scores = (q_nope W_UK) . latent +
        q_pe . k_pe`` over ``sqrt(dq + dr)``, ``ctx = (probs @ latent) W_UV^T``; no
        communication (the latent is replicated, the heads are this rank's); ``kv_cache``'s
        mask (causal, left padding)."""
        s, b, nh, _ = q_nope.shape
        S = latent.shape[0]
        w = self.linear_kv_up_proj.weight.view(nh, self.dq + self.dv, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.dq, self.dv], dim=1)
        q_lat = torch.einsum("sbnd,ndc->bnsc", q_nope, w_uk)             # [b, n, s, c]
        scores = (torch.einsum("bnsc,Sbc->bnsS", q_lat, latent)
                  + torch.einsum("sbnr,Sbr->bnsS", q_pe, k_pe)).float()
        scores = scores / math.sqrt(self.dq + self.dr)
        blocked = kv_cache.blocked(s, S, b, q_nope.device)             # causal, pads
        probs = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1).to(latent.dtype)
        out_latent = torch.einsum("bnsS,Sbc->sbnc", probs, latent)      # [s, b, n, c]
        ctx = torch.einsum("sbnc,nvc->sbnv", out_latent, w_uv)           # [s, b, n, dv]
        return ctx.reshape(s, b, nh * self.dv)

    def forward(self, x: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                document_ids: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor:
        """As :meth:`SelfAttention.forward`. With ``kv_cache`` (inference) the layer caches
        the normalised kv latent ``[S, b, 1, kv_lora_rank]`` and the roped shared key
        ``[S, b, 1, dr]`` (replicated over tp) instead of full keys and values: the
        first forward into an empty cache (the prompt) attends with the up-projected keys
        and values, later steps with the absorbed projections (:meth:`_absorbed`)."""
        if rotary is None:
            raise ValueError("multi-latent attention needs its rotary (cos, sin)")
        cos, sin = rotary
        latents = self._latents(x)
        training = self.training and torch.is_grad_enabled()
        if kv_cache is not None:
            return self.linear_proj(self._cached(kv_cache, *latents, cos, sin))
        ckpt = dict(use_reentrant=False, context_fn=self.rng.recompute_context_fn)
        if training and self.recompute_up_proj and self.recompute_core:
            ctx = checkpoint(self._attend, *latents, cos, sin, document_ids, **ckpt)
        else:
            if training and self.recompute_up_proj:
                q, k, v = checkpoint(self._up_proj_and_rope, *latents, cos, sin, **ckpt)
            else:
                q, k, v = self._up_proj_and_rope(*latents, cos, sin)
            self._observe(q, k, document_ids)
            if training and self.recompute_core:
                ctx = checkpoint(self.core_attention, q, k, v, document_ids, **ckpt)
            else:
                ctx = self.core_attention(q, k, v, document_ids)
        return self.linear_proj(ctx)                                 # [s(/tp), b, h]


def mla_softmax_scale(cfg) -> float:
    """The softmax scale multi-latent attention computes with (module docstring)."""
    return (softmax_scale_factor(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
            / math.sqrt(cfg.mla_q_head_dim))


def latent_cache_values_per_token(cfg) -> tuple[int, int]:
    """(values the latent KV cache holds per token and layer, ``kv_lora_rank +
    qk_pos_emb_head_dim``; values full keys and values would, ``heads * (qk_head_dim +
    qk_pos_emb_head_dim + v_head_dim)``), over all tensor-parallel ranks."""
    latent = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    full = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
                                      + cfg.v_head_dim)
    return latent, full
