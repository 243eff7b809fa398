"""The reference kernel: explicit scores, causal mask and an fp32 softmax."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megalite.transformer.attention_kernels.context_parallel.blocks import explicit_block
from megalite.transformer.attention_kernels.base import (
    CoreAttention,
    from_batch_heads,
    to_batch_heads,
)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dropout_p: float) -> torch.Tensor:
    """``[b, nh, s, d]`` queries, ``[b, ng, s, d]`` keys/values -> ``[b, nh, s, d]``."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs.to(v.dtype), v)


class LocalAttention(CoreAttention):
    name = "local"
    lse_block = staticmethod(explicit_block)

    def attend(self, q, k, v, dropout_p):
        return from_batch_heads(local_attention(*to_batch_heads(q, k, v), dropout_p))
