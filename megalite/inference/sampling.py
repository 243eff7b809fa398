"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import ConfigError


class SamplingError(ConfigError):
    """Sampling parameters out of range."""


@dataclass
class SamplingParams:
    """``temperature`` 0 is greedy (argmax); ``top_k`` 0 and ``top_p`` 0 or 1 disable
    those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def check(self) -> SamplingParams:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top-k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise SamplingError(f"top-p must be in [0, 1], got {self.top_p}")
        return self


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """fp32 ``[b, V]`` -> ``[b, V]`` with the tokens outside the top ``top_k`` and outside
    the smallest set whose probability reaches ``top_p`` set to -inf (the most likely
    token always stays)."""
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token
        drop[..., 0] = False
        sorted_logits[drop] = float("-inf")
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens int64 ``[b]`` from logits ``[b, V]`` (any float dtype)."""
    logits = logits.float()
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
