"""YaRN RoPE (context extension by NTK-by-parts interpolation) as multi-latent attention
uses it, with Megatron-Core's and Hugging Face's formulas.

* Frequencies: channel pair ``i`` of a ``dim``-channel RoPE keeps its frequency
  ``base^(-2i/dim)`` (extrapolation) below the correction range, takes it divided by the
  scaling factor (interpolation) above it, and a linear blend in between. The range is
  where a pair makes between ``beta_fast`` (32) and ``beta_slow`` (1) rotations over the
  original context (``original_max_position_embeddings``), rounded outwards to whole pairs.
* cos/sin are multiplied by the concentration factor
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` with
  ``mscale(s, m) = 0.1 m ln(s) + 1`` (1 for ``s <= 1``).
* The softmax scale of attention becomes ``mscale(factor, mscale_all_dim)^2 / sqrt(d)``
  (:func:`softmax_scale_factor`).

With a scaling factor of 1 all of this is plain RoPE.
"""

from __future__ import annotations

import math

import torch

from megalite.transformer.rope import RotaryEmbedding

BETA_FAST, BETA_SLOW = 32.0, 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(scale) + 1``, or 1 when ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def concentration_factor(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor on cos and sin (Megatron-Core's ``_yarn_get_concentration_factor``)."""
    return yarn_mscale(scale, mscale) / yarn_mscale(scale, mscale_all_dim)


def softmax_scale_factor(scale: float, mscale_all_dim: float) -> float:
    """What multiplies ``1/sqrt(d)`` in the softmax: ``mscale(scale, mscale_all_dim)^2``."""
    return yarn_mscale(scale, mscale_all_dim) ** 2


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, scale: float, original_max_positions: int,
                  beta_fast: float = BETA_FAST, beta_slow: float = BETA_SLOW) -> torch.Tensor:
    """fp32 ``[dim/2]`` inverse frequencies (module docstring)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extra = 1.0 / base ** exponent
    inter = 1.0 / (scale * base ** exponent)
    low = max(math.floor(_correction_dim(beta_fast, dim, base, original_max_positions)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, dim, base, original_max_positions)),
               dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp                       # 1: extrapolate (high frequencies)
    return inter * (1 - keep) + extra * keep


class YarnRotaryEmbedding(RotaryEmbedding):
    """Position ids ``[s, b]`` -> ``(cos, sin)``, each fp32 ``[s, b, 1, dim]``, from YaRN's
    frequencies and scaled by the concentration factor (module docstring). ``cfg`` is a
    ``ModelConfig`` with ``--multi-latent-attention``: ``dim`` is its
    ``qk_pos_emb_head_dim``."""

    def __init__(self, cfg, device=None):
        dim = cfg.qk_pos_emb_head_dim
        super().__init__(dim, 1.0, cfg.rotary_base, device=device)
        inv_freq = yarn_inv_freq(dim, cfg.rotary_base, cfg.rotary_scaling_factor,
                                 cfg.original_max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_factor = concentration_factor(cfg.rotary_scaling_factor, cfg.mscale,
                                                     cfg.mscale_all_dim)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(position_ids)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin
