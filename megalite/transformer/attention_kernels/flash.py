"""flash-attn's ``flash_attn_func``: CUDA with fp16/bf16 only, imported when first used."""

from __future__ import annotations

import importlib.util

import torch

from megalite.transformer.attention_kernels.base import CoreAttention
from megalite.transformer.attention_kernels.context_parallel.blocks import flash_block


class FlashAttention(CoreAttention):
    name = "flash"
    lse_block = staticmethod(flash_block)
    needs_same_head_dims = True

    @classmethod
    def unavailable(cls, device, dtype):
        if (torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                and importlib.util.find_spec("flash_attn") is not None):
            return None
        return "flash-attn installed, a CUDA device and --bf16/--fp16"

    def attend(self, q, k, v, dropout_p):
        from flash_attn import flash_attn_func

        s, b, nh, d = q.shape
        out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                              dropout_p=dropout_p, causal=True)  # [b, s, nh, d]
        return out.transpose(0, 1).reshape(s, b, -1)
