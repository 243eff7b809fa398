"""Autoregressive generation with a GPTModel on one process (tp across ranks: later).

:func:`generate` runs the prompt once through the model filling an
:class:`~megalite.inference.kv_cache.InferenceCache`, then feeds one token per step, so
each new token costs one token's forward. Without the cache (``use_cache=False``) every
step re-runs the whole sequence: the reference the cache is tested against.
"""

from __future__ import annotations

import torch

from megalite.config import ConfigError
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.sampling import SamplingParams, sample


class GenerationError(ConfigError):
    """A prompt or request the model cannot serve (empty, too long, bad token ids)."""


def max_sequence_length(cfg) -> int:
    """The most tokens (prompt + generated) the model was trained to see: its
    ``seq_length`` (learned positions cap it at ``max_position_embeddings`` too)."""
    limit = cfg.seq_length
    if cfg.learned_positions and cfg.max_position_embeddings:
        limit = min(limit, cfg.max_position_embeddings)
    return limit


def check_prompt(prompt: list[int], cfg) -> None:
    if not prompt:
        raise GenerationError("the prompt is empty (no tokens)")
    limit = max_sequence_length(cfg)
    if len(prompt) >= limit:
        raise GenerationError(f"the prompt has {len(prompt)} tokens; the model's sequence "
                              f"length is {limit}, which leaves no room to generate")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the model's "
                              f"vocabulary of {cfg.vocab_size}")


def _last_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """``[b, s, V_padded]`` -> fp32 ``[b, V]`` of the last position, padding removed."""
    return logits[:, -1, :model.config.vocab_size].float()


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int,
             params: SamplingParams | None = None, *, eod: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; fewer when the
    end-of-document token ``eod`` is drawn (it is included) or the sequence reaches
    :func:`max_sequence_length`)."""
    params = (params or SamplingParams(temperature=0.0)).check()
    cfg = model.config
    check_prompt(prompt, cfg)
    if max_new_tokens < 0:
        raise GenerationError(f"max new tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = min(len(prompt) + max_new_tokens, max_sequence_length(cfg))
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)  # [1, s]
    cache = InferenceCache(total) if use_cache else None
    out: list[int] = []
    step_input = ids
    try:
        while ids.shape[1] < total:
            logits = model(step_input if use_cache else ids, inference_cache=cache)
            token = sample(_last_logits(model, logits), params, generator)  # [1]
            out.append(int(token.item()))
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
            step_input = token.view(1, 1)
            if eod is not None and out[-1] == eod:
                break
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def sequence_logits(model, tokens: list[int], use_cache: bool) -> torch.Tensor:
    """fp32 ``[s, V]`` logits of every position of ``tokens``: in one forward, or with
    the cache one token at a time (each from the cached keys of the earlier ones)."""
    model.eval()
    ids = torch.tensor([tokens], dtype=torch.int64, device=next(model.parameters()).device)
    vocab = model.config.vocab_size
    if not use_cache:
        return model(ids)[0, :, :vocab].float()
    cache = InferenceCache(len(tokens))
    rows = [model(ids[:, i:i + 1], inference_cache=cache)[0, -1, :vocab].float()
            for i in range(len(tokens))]
    return torch.stack(rows)
