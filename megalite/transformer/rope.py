"""Rotary position embeddings in the rotate-half layout of GPT-NeoX / Hugging Face Llama.

A head vector's first ``rot_dim`` channels are rotated as two halves,
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` with frequency i paired between channel
i and ``i + rot_dim/2``; the remaining channels (``rotary_percent < 1``) pass through.
Using Hugging Face's layout natively means Llama q/k weights convert without permutation.
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """Position ids ``[s, b]`` -> ``(cos, sin)``, each fp32 ``[s, b, 1, rot_dim]``."""

    def __init__(self, head_dim: int, rotary_percent: float = 1.0, base: float = 10000.0,
                 device=None):
        super().__init__()
        rot_dim = int(head_dim * rotary_percent)
        if rot_dim % 2 or rot_dim == 0:
            raise ValueError(f"rotary dim {rot_dim} (head dim {head_dim} x rotary_percent "
                             f"{rotary_percent}) must be even and positive")
        exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
        inv_freq = 1.0 / (base ** exponent)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.unsqueeze(-1).float() * self.inv_freq  # [s, b, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by ``cos``/``sin`` ``[s, b|1, 1, rot_dim]``."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
