"""fp8 formats and scaling recipes: how a tensor becomes fp8 values and scales.

A quantised operand is fp8 values ``q`` and a dequantisation scale ``d`` with
``x ~= q * d`` (``d`` is what ``torch._scaled_mm`` takes as ``scale_a`` / ``scale_b``).

- **tensorwise** (current scaling): one fp32 ``d = amax / fp8_max * 2**margin`` from this
  tensor's absolute maximum, taken now.
- **delayed**: the same formula with ``amax`` read from a history of earlier steps'
  maxima (``most_recent`` or ``max`` of ``--fp8-amax-history-len`` steps); see
  :mod:`megalite.layers.fp8.scaling`.
- **mxfp8**: blocks of :data:`MX_BLOCK` consecutive elements along the GEMM's contraction
  dimension share a power-of-two scale stored as ``float8_e8m0fnu`` (the OCP MX rule:
  ``d = 2**(floor(log2(amax)) - emax)`` where ``emax`` is the element format's largest
  exponent, 8 for e4m3 and 15 for e5m2; values beyond fp8_max saturate).
- **blockwise**: blocks of :data:`BLOCKWISE_BLOCK` elements along the contraction dimension
  with an fp32 ``d = amax / fp8_max`` each (DeepSeek-V3's 1 x 128 tiles; weights use the
  same 1 x 128 tiles here rather than 128 x 128).

Formats: ``e4m3`` quantises every operand to ``float8_e4m3fn``; ``hybrid`` quantises the
forward operands to e4m3 and output gradients to ``float8_e5m2``.
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.config.fp8 import FP8_TILE
from megalite.config.shapes import fp8_layer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}
MX_EMAX = {E4M3: 8, E5M2: 15}      # exponent of the largest normal value (448, 57344)
MX_BLOCK = FP8_TILE["mxfp8"]                  # 32
BLOCKWISE_BLOCK = FP8_TILE["blockwise"]       # 128
BLOCK_RECIPES = {"mxfp8": MX_BLOCK, "blockwise": BLOCKWISE_BLOCK}


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """One run's fp8 settings (``ModelConfig``'s fp8 fields), shared by all its linears."""

    format: str = "e4m3"             # e4m3 | hybrid
    recipe: str = "tensorwise"       # tensorwise | delayed | mxfp8 | blockwise
    margin: int = 0
    history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True               # False: the weight gradient GEMM in higher precision

    @classmethod
    def from_config(cls, cfg) -> Fp8Recipe | None:
        """The recipe of ``cfg`` (a ``ModelConfig``); None without ``--fp8-format``."""
        if cfg.fp8_format is None:
            return None
        return cls(cfg.fp8_format, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len,
                   cfg.fp8_amax_compute_algo, cfg.fp8_wgrad)

    @classmethod
    def for_layer(cls, cfg, layer_number: int) -> Fp8Recipe | None:
        """The recipe of transformer layer ``layer_number`` (global, 0-based): None for
        the layers ``--first-last-layers-bf16`` keeps in higher precision
        (``--num-layers-at-start-in-bf16`` first, ``--num-layers-at-end-in-bf16`` last)."""
        return cls.from_config(cfg) if fp8_layer(cfg, layer_number) else None

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def block(self) -> int | None:
        """Block length along the contraction dimension; None for per-tensor scales."""
        return BLOCK_RECIPES.get(self.recipe)


# -- per-tensor scales --------------------------------------------------------------------
def dequant_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``d = amax / fp8_max * 2**margin`` (fp32, any shape); 1 where ``amax`` is 0 or not
    finite, so that an all-zero tensor quantises to zeros."""
    amax = amax.float()
    d = amax / FP8_MAX[dtype] * (2.0 ** margin)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, d, torch.ones_like(d))


def quantize(x: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values of ``x / d`` (``d`` broadcast), saturated to +-fp8_max."""
    limit = FP8_MAX[dtype]
    return (x.float() / d).clamp_(-limit, limit).to(dtype)


def quantize_both(x: torch.Tensor, d: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` quantised once (:func:`quantize`) into both layouts the GEMMs take:
    (``[M, K]`` row-major, its transpose ``[K, M]`` row-major), where the operand is
    quantised, so no later pass goes back to an fp8 copy to transpose it. Under
    ``torch.compile`` inductor makes this one kernel reading ``x`` once and writing both
    (seen on the CPU: the quantising loop, then a tiled transpose of the values it just
    wrote);
    eager, the transposed copy is made from the fp8 values (one byte per element: on a
    CPU several times cheaper than casting the transposed fp32 view; same values)."""
    q = quantize(x, d, dtype)
    return q, q.t().contiguous()


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a fp32 scalar tensor (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


# -- block scales ---------------------------------------------------------------------------
def block_quantize(x: torch.Tensor, block: int, dtype: torch.dtype, *, mx: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` -> (fp8 values ``[..., K]``, scales ``[..., K / block]``), one scale
    per ``block`` consecutive elements of the last dimension (``K`` a multiple of
    ``block``). ``mx``: power-of-two scales as ``float8_e8m0fnu`` (OCP MX); otherwise fp32
    ``amax / fp8_max``. Both row-major whatever ``x``'s strides (a transposed view is read
    once into row-major blocks), as a block-scaled kernel takes them."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"fp8 block scaling: dimension {k} is not a multiple of the "
                         f"block size {block}")
    blocks = x.contiguous().float().reshape(*x.shape[:-1], k // block, block)
    amax = blocks.abs().amax(-1)
    if mx:
        tiny = torch.finfo(torch.float32).tiny
        exp = torch.floor(torch.log2(amax.clamp(min=tiny))) - MX_EMAX[dtype]
        d = torch.exp2(exp.clamp(-127.0, 127.0))
        scales = d.to(torch.float8_e8m0fnu)
        d = scales.float()          # exactly the stored power of two
    else:
        d = dequant_scale(amax, dtype)
        scales = d
    q = quantize(blocks, d.unsqueeze(-1), dtype)
    return q.reshape(x.shape), scales


def block_dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` of :func:`block_quantize`'s output, ``[..., K]``."""
    k, n = q.shape[-1], scales.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], n, k // n) * scales.float().unsqueeze(-1)
    return blocks.reshape(q.shape)
