"""PyTorch's fused ``scaled_dot_product_attention`` (any device, any dtype)."""

from __future__ import annotations

import torch.nn.functional as F

from megalite.transformer.attention_kernels.context_parallel.blocks import sdpa_block
from megalite.transformer.attention_kernels.base import (
    CoreAttention,
    from_batch_heads,
    to_batch_heads,
)


class SdpaAttention(CoreAttention):
    name = "sdpa"
    lse_block = staticmethod(sdpa_block)

    def attend(self, q, k, v, dropout_p):
        nh = q.shape[2]
        q, k, v = to_batch_heads(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                             enable_gqa=k.shape[1] != nh)
        return from_batch_heads(out)
