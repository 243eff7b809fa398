"""Autoregressive generation with a GPTModel, on one process, tensor or pipeline parallel.

:func:`generate_batch` left-pads a batch of prompts, runs them once through the model
filling an :class:`~megalite.inference.kv_cache.InferenceCache` (pad keys masked, each
row's positions counted from its first real token), then feeds one token per row per
step, so each new token costs one token's forward. :func:`generate` is one prompt.
Without the cache (``use_cache=False``) every step re-runs the whole sequence: the
reference the cache is tested against.

Under tensor parallelism every rank of ``model.ps.tp`` runs this with the same prompts:
each rank caches its own heads' keys/values, the last position's logits are all-gathered
over the tp group (``[b, V_padded/tp]`` -> ``[b, V_padded]``), and the token tp rank 0
chooses is broadcast over the tp group, so every rank feeds the same next token. Under
pipeline parallelism every rank of the world runs this with the same prompts; each stage
runs its layers and caches their keys/values, the hidden state goes from stage to stage
(:mod:`megalite.inference.stages`: the whole batch at once, no micro-batch pipelining),
the last stage samples, and its tokens are broadcast over ``ps.pp`` to every stage.

:func:`generate_batch` also takes a request's :class:`~megalite.inference.scoring.DecodeRules`
(more stop tokens, a banned newline after a colon) and a
:class:`~megalite.inference.scoring.TokenScores` to fill with the log-probability of each
token (the server's ``logprobs`` / ``top_n_logprobs``).
"""

from __future__ import annotations

import torch

from megalite.config import ConfigError
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.sampling import SamplingParams, sample
from megalite.inference.scoring import DecodeRules, TokenScores
from megalite.inference.stages import share_tokens, stage_forward
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region


class GenerationError(ConfigError):
    """A prompt or request the model cannot serve (empty, too long, bad token ids)."""


def max_sequence_length(cfg) -> int:
    """The most tokens (prompt + generated) the model was trained to see: its
    ``seq_length`` (learned positions cap it at ``max_position_embeddings`` too)."""
    limit = cfg.seq_length
    if cfg.learned_positions and cfg.max_position_embeddings:
        limit = min(limit, cfg.max_position_embeddings)
    return limit


def check_prompt(prompt: list[int], cfg, generating: bool = True) -> None:
    """A prompt the model can take: not empty, its ids in the vocabulary, and shorter than
    the sequence length (``generating``: room for one new token) or at most as long
    (scoring it only)."""
    if not prompt:
        raise GenerationError("the prompt is empty (no tokens)")
    limit = max_sequence_length(cfg)
    if len(prompt) >= limit and generating:
        raise GenerationError(f"the prompt has {len(prompt)} tokens; the model's sequence "
                              f"length is {limit}, which leaves no room to generate")
    if len(prompt) > limit:
        raise GenerationError(f"the prompt has {len(prompt)} tokens; the model's "
                              f"sequence length is {limit}")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise GenerationError(f"prompt token ids {bad[:5]} are outside the model's "
                              f"vocabulary of {cfg.vocab_size}")


def _last_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """This rank's ``[b, s, V_padded/tp]`` -> fp32 ``[b, V]`` of the last position, the
    vocabulary all-gathered over ``model.ps.tp`` and its padding removed."""
    last = gather_from_tensor_model_parallel_region(logits[:, -1].float(), model.ps.tp)
    return last[:, :model.config.vocab_size]


def _choose(model, logits: torch.Tensor | None, params: SamplingParams,
            generator: torch.Generator | None, rules: DecodeRules | None = None,
            last: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[b]``: the next tokens, sampled on the last pipeline stage (``logits``
    None elsewhere) and the same on every rank (:func:`stages.share_tokens`); ``rules``
    ban tokens after each row's ``last`` token (int64 ``[b]``)."""
    tokens = None
    if logits is not None:
        full = _last_logits(model, logits)
        if rules is not None:
            full = rules.ban(full, last)
        tokens = sample(full, params, generator)
    return share_tokens(model, tokens)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int,
             params: SamplingParams | None = None, *, eod: int | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """The new token ids after ``prompt`` (at most ``max_new_tokens``; fewer when the
    end-of-document token ``eod`` is drawn (it is included) or the sequence reaches
    :func:`max_sequence_length`)."""
    return generate_batch(model, [prompt], max_new_tokens, params, eod=eod,
                          generator=generator, use_cache=use_cache)[0]


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int,
                   params: SamplingParams | None = None, *, eod: int | None = None,
                   generator: torch.Generator | None = None, pad_id: int = 0,
                   use_cache: bool = True, rules: DecodeRules | None = None,
                   scores: TokenScores | None = None) -> list[list[int]]:
    """The new token ids after each of ``prompts``, decoded together in one batch (the
    rows of :func:`generate`, each stopping on its own at ``eod``, ``max_new_tokens`` or
    :func:`max_sequence_length`). Rows are left-padded with ``pad_id`` to the longest
    prompt; greedy output equals generating each prompt alone. A finished row keeps
    feeding its last token until every row is done; what it draws is dropped.

    ``rules``: more stop tokens and banned tokens (:class:`DecodeRules`); the token that
    ends a row is kept, as ``eod`` is. ``scores``: filled with the log-probability of
    every token of each row after its first -- the prompt's, then the new ones
    (``len(prompt) - 1 + len(new)`` entries) -- on every rank."""
    params = (params or SamplingParams(temperature=0.0)).check()
    cfg = model.config
    if not prompts:
        raise GenerationError("no prompts to generate from")
    for prompt in prompts:
        check_prompt(prompt, cfg)
    if max_new_tokens < 0:
        raise GenerationError(f"max new tokens must be >= 0, got {max_new_tokens}")
    limit = max_sequence_length(cfg)
    lengths = [len(p) for p in prompts]
    budget = [min(max_new_tokens, limit - n) for n in lengths]  # new tokens per row
    width = max(lengths)
    pads = torch.tensor([width - n for n in lengths], dtype=torch.int64)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.int64,
                       device=device)  # [b, width]
    total = width + max(budget)
    out: list[list[int]] = [[] for _ in prompts]
    done = [n == 0 for n in budget]
    was_training = model.training
    model.eval()
    cache = InferenceCache(total, pads if len(prompts) > 1 else None)
    step_input = ids
    step = 0
    try:
        while not all(done):
            # a finished row's positions may run past the limit: clamped, never used
            if use_cache:
                pos = cache.position_ids(len(prompts), step_input.shape[1], device)
                logits = stage_forward(model, step_input, pos.clamp_max(limit - 1), cache)
            elif len(prompts) > 1:  # a fresh cache: one full forward with padding masked
                fresh = InferenceCache(ids.shape[1], pads)
                pos = fresh.position_ids(len(prompts), ids.shape[1], device)
                logits = stage_forward(model, ids, pos.clamp_max(limit - 1), fresh)
            else:
                logits = stage_forward(model, ids)
            tokens = _choose(model, logits, params, generator, rules, step_input[:, -1])
            if scores is not None and logits is not None:
                _record(model, scores, logits, step, ids, tokens, pads, done)
            for r, token in enumerate(tokens.tolist()):
                if done[r]:
                    continue
                previous = out[r][-1] if out[r] else prompts[r][-1]
                out[r].append(token)
                done[r] = (len(out[r]) >= budget[r] or (eod is not None and token == eod)
                           or (rules is not None and rules.ends(previous, token)))
            keep = torch.tensor([[o[-1] if o else p[-1]] for o, p in zip(out, prompts)],
                                dtype=torch.int64, device=device)  # [b, 1]
            step_input = torch.where(torch.tensor(done, device=device).view(-1, 1), keep,
                                     tokens.view(-1, 1))
            ids = torch.cat([ids, step_input], dim=1)
            step += 1
    finally:
        model.train(was_training)
    if scores is not None:
        scores.share(model)
    return out


def _record(model, scores: TokenScores, logits: torch.Tensor, step: int, ids: torch.Tensor,
            tokens: torch.Tensor, pads: torch.Tensor, done: list[bool]) -> None:
    """Score a step's positions: at the first step every real prompt position of each row
    (each scores the next prompt token, the last one the drawn token), later the last
    position of each row still generating (the drawn token). ``ids`` ``[b, width]``: the
    tokens fed so far; ``tokens`` ``[b]``: those just drawn."""
    drawn = tokens.view(-1, 1).to(ids.device)
    if step == 0:
        targets = torch.cat([ids[:, 1:], drawn], dim=1)
        width = ids.shape[1]
        spans = [None if d else (int(p), width) for p, d in zip(pads.tolist(), done)]
        scores.add(model, logits, targets, spans)
    else:
        scores.add(model, logits[:, -1:], drawn, [None if d else (0, 1) for d in done])
