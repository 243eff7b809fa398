"""Rotary position embeddings in the rotate-half layout of GPT-NeoX / Hugging Face Llama.

A head vector's first ``rot_dim`` channels are rotated as two halves,
``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` with frequency i paired between channel
i and ``i + rot_dim/2``; the remaining channels (``rotary_percent < 1``) pass through.
Using Hugging Face's layout natively means Llama q/k weights convert without permutation.

:func:`apply_rotary` computes exactly that formula without building ``rotate_half(x)``
(no ``torch.cat`` copies): eagerly through :class:`_Rotary`, which writes both halves
into one output and rotates the gradient back by ``-theta`` in backward; under
``torch.compile`` as the plain expression, which inductor fuses into one kernel. Both give
the same values as ``x * cos + rotate_half(x) * sin`` bit for bit (the same products and
sums).
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """Position ids ``[s, b]`` -> ``(cos, sin)``, each fp32 ``[s, b, 1, rot_dim]``.

    Any position ids work (a context-parallel rank passes those of its own chunks); both
    halves of ``rot_dim`` hold the same frequencies."""

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


def _rotate(x1, x2, cos, sin, out1, out2) -> None:
    """``out1 = x1 cos - x2 sin``, ``out2 = x2 cos + x1 sin`` (one temporary)."""
    tmp = torch.mul(x2, sin)
    torch.mul(x1, cos, out=out1).sub_(tmp)
    torch.mul(x1, sin, out=tmp)
    torch.mul(x2, cos, out=out2).add_(tmp)


class _Rotary(torch.autograd.Function):
    """``x`` ``[s, b, heads, d]`` rotated by the half-width ``cos`` / ``sin``
    ``[s, b|1, 1, rot/2]`` (in ``x``'s dtype); channels from ``rot`` on pass through."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = cos.shape[-1]
        rot = 2 * half
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _rotate(x[..., :half], x[..., half:rot], cos, sin, out[..., :half], out[..., half:rot])
        if rot < x.shape[-1]:
            out[..., rot:] = x[..., rot:]
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        # the transpose of a rotation by theta is the rotation by -theta (sin -> -sin):
        # dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin
        cos, sin = ctx.saved_tensors
        half = cos.shape[-1]
        rot = 2 * half
        g1, g2 = grad[..., :half], grad[..., half:rot]
        dx = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        tmp = torch.mul(g2, sin)
        torch.mul(g1, cos, out=dx[..., :half]).add_(tmp)
        torch.mul(g1, sin, out=tmp)
        torch.mul(g2, cos, out=dx[..., half:rot]).sub_(tmp)
        if rot < grad.shape[-1]:
            dx[..., rot:] = grad[..., rot:]
        return dx, None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by ``cos``/``sin`` ``[s, b|1, 1, rot_dim]`` (as
    :class:`RotaryEmbedding` returns them); a new tensor in ``x``'s dtype."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    if not torch.compiler.is_compiling():
        return _Rotary.apply(x, cos, sin)
    rot = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rot < x.shape[-1]:
        parts.append(x[..., rot:])
    return torch.cat(parts, dim=-1)
