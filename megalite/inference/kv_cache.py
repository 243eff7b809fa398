"""A key/value cache for incremental decoding, passed explicitly through the model.

``GPTModel.forward(..., inference_cache=cache)`` hands each layer its
:class:`LayerKVCache` (``cache.layer(i)``); the layer's attention writes this step's keys
and values at positions ``cache.seq_len ..`` and attends the new queries to every cached
key (causal among the new tokens). After the forward, the model advances ``seq_len``. The
training path never builds one (the argument defaults to None), so training numerics do
not change.

Buffers are preallocated ``[max_len, b, groups/tp, d]`` per layer (under tensor
parallelism each rank caches only its own heads' keys and values), so a decoding step
costs one token's forward plus attention over the cache, not a re-run of the prefix.

A batch of prompts of different lengths is left-padded: ``InferenceCache(max_len,
pad_lengths=...)`` records each row's padding, and no real token attends to a pad key
(a pad query sees its own key only, so its output stays finite and unused).
"""

from __future__ import annotations

import math

import torch


class InferenceCacheError(ValueError):
    """The cache cannot hold the requested tokens."""


class LayerKVCache:
    """Keys and values of one layer: ``[max_len, b, groups, d]`` each, filled up to the
    parent's ``seq_len`` (plus the step being written). Multi-latent attention stores its
    normalised kv latent ``[max_len, b, 1, kv_lora_rank]`` as ``k`` and its roped shared
    key ``[max_len, b, 1, qk_pos_emb_head_dim]`` as ``v`` (``append`` takes any widths)."""

    def __init__(self, parent: InferenceCache):
        self.parent = parent
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[s_new, b, groups, d]`` after the cached tokens and return
        all keys and values so far, ``[seq_len + s_new, b, groups, d]``."""
        start, s = self.parent.seq_len, k.shape[0]
        end = start + s
        if end > self.parent.max_len:
            raise InferenceCacheError(
                f"the KV cache holds {self.parent.max_len} tokens; {end} requested")
        if self.k is None:   # v's head dim may differ from k's (multi-latent attention)
            self.k = torch.empty((self.parent.max_len, *k.shape[1:]), dtype=k.dtype,
                                 device=k.device)
            self.v = torch.empty((self.parent.max_len, *v.shape[1:]), dtype=v.dtype,
                                 device=v.device)
        self.k[start:end] = k
        self.v[start:end] = v
        return self.k[:end], self.v[:end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:func:`cached_attention` of the new queries over the keys/values ``append``
        returned, masking the batch's left padding."""
        return cached_attention(q, k, v, self.parent.pad_lengths)

    def blocked(self, s: int, S: int, b: int, device=None) -> torch.Tensor:
        """The mask :meth:`attend` applies (:func:`blocked_keys`), for a layer that attends
        over the cache itself (multi-latent attention's absorbed form)."""
        return blocked_keys(s, S, b, self.parent.pad_lengths, device)


class InferenceCache:
    """Per-layer key/value caches of one batch of sequences decoded together.

    ``max_len``: the most tokens (prompt + generated) any sequence reaches.
    ``seq_len``: the tokens already cached (the next token's position).
    ``pad_lengths``: int64 ``[b]``, the left-padding tokens of each row (None: none);
    row ``r``'s token at cache index ``i`` has position ``i - pad_lengths[r]``.
    """

    def __init__(self, max_len: int, pad_lengths: torch.Tensor | None = None):
        self.max_len = max_len
        self.seq_len = 0
        self.pad_lengths = pad_lengths
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, layer_number: int) -> LayerKVCache:
        if layer_number not in self._layers:
            self._layers[layer_number] = LayerKVCache(self)
        return self._layers[layer_number]

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def position_ids(self, batch: int, num_tokens: int, device=None) -> torch.Tensor:
        """int64 ``[b, num_tokens]`` positions of the next ``num_tokens`` tokens of each
        row (0 for pad tokens)."""
        idx = torch.arange(self.seq_len, self.seq_len + num_tokens, device=device)
        pos = idx.expand(batch, num_tokens)
        if self.pad_lengths is not None:
            pos = (pos - self.pad_lengths.to(device).view(-1, 1)).clamp_min(0)
        return pos


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     pad_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Queries ``[s, b, nh, d]`` of the last ``s`` positions, keys/values
    ``[S, b, ng, d]`` of all ``S >= s`` positions -> context ``[s, b, nh * d]``.

    Query ``i`` (position ``S - s + i``) sees keys ``0 .. S - s + i``, except row ``r``'s
    first ``pad_lengths[r]`` keys (left padding; int64 ``[b]``), which only their own
    query sees; scores and softmax in fp32 (as the ``local`` kernel)."""
    s, b, nh, d = q.shape
    S, ng = k.shape[0], k.shape[2]
    qb = q.permute(1, 2, 0, 3)  # [b, nh, s, d]
    kb, vb = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, ng, S, d]
    if nh != ng:
        kb = kb.repeat_interleave(nh // ng, dim=1)
        vb = vb.repeat_interleave(nh // ng, dim=1)
    scores = torch.matmul(qb, kb.transpose(-1, -2)).float() / math.sqrt(d)  # [b, nh, s, S]
    blocked = blocked_keys(s, S, b, pad_lengths, q.device)
    probs = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)
    ctx = torch.matmul(probs.to(vb.dtype), vb)  # [b, nh, s, d]
    return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, nh * dv]


def blocked_keys(s: int, S: int, b: int, pad_lengths: torch.Tensor | None,
                 device=None) -> torch.Tensor:
    """bool ``[s, S]`` (``[b, 1, s, S]`` with ``pad_lengths``): True where query ``i`` of the
    last ``s`` positions may not see key ``j`` (:func:`cached_attention`'s rule)."""
    blocked = torch.ones(s, S, dtype=torch.bool, device=device).triu(S - s + 1)
    if pad_lengths is not None:
        key_pos = torch.arange(S, device=device)
        pad_key = key_pos.view(1, S) < pad_lengths.to(device).view(b, 1)  # [b, S]
        own = key_pos.view(1, S) == (key_pos[S - s:]).view(s, 1)  # [s, S]
        blocked = (blocked.view(1, s, S) | (pad_key.view(b, 1, S) & ~own)).view(b, 1, s, S)
    return blocked
