"""Token log-probabilities and the request-level stopping rules of generation.

:class:`TokenScores` records, for each row of a batch, the model's log-probability of each
token given the tokens before it (the log-softmax of the raw logits, before temperature,
top-k/top-p or a banned token) and optionally the ``top_n`` most likely tokens at each
position. It is filled on the last pipeline stage (under tensor parallelism every tp rank
gathers the vocabulary and computes the same numbers) and :meth:`TokenScores.share` gives
it to every stage. :func:`score_batch` scores whole prompts in one forward (no
generation). :class:`DecodeRules` are the stop tokens and the banned newline after a colon
of a request, in token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalite.inference.kv_cache import InferenceCache
from megalite.inference.stages import from_last_stage, stage_forward
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region

POSITIONS_PER_CHUNK = 512   # full-vocabulary rows materialized at once per batch row


@dataclass
class DecodeRules:
    """What ends a row besides end-of-document and the token budget, and what it may not
    draw. ``stop_ids``: a row ends after drawing one of them. ``stop_on_eol``: after
    ``newline`` or ``double_newline``; ``stop_on_double_eol``: after ``double_newline`` or a
    ``newline`` that follows one. ``banned_after``: {token: ids it may not be followed by}
    (a newline after a colon)."""

    stop_ids: tuple[int, ...] = ()
    newline: int | None = None
    double_newline: int | None = None
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    banned_after: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def ends(self, previous: int, token: int) -> bool:
        """Whether a row that drew ``token`` after ``previous`` is finished."""
        if token in self.stop_ids:
            return True
        eols = {self.newline, self.double_newline} - {None}
        if self.stop_on_eol and token in eols:
            return True
        return self.stop_on_double_eol and token is not None and (
            token == self.double_newline
            or (token == self.newline and previous == self.newline))

    def ban(self, logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """fp32 ``[b, V]`` with the ids banned after each row's ``last`` token (int64
        ``[b]``) set to -inf."""
        if not self.banned_after:
            return logits
        logits = logits.clone()
        for token, banned in self.banned_after.items():
            rows = (last.to(logits.device) == token).nonzero().flatten()
            if len(rows) and banned:
                logits[rows.view(-1, 1), torch.tensor(banned, device=logits.device)] = (
                    float("-inf"))
        return logits


def full_log_softmax(model, local: torch.Tensor) -> torch.Tensor:
    """This rank's logits ``[..., V_padded/tp]`` -> fp32 log-probabilities ``[..., V]``
    over the whole vocabulary (gathered over ``model.ps.tp``, padding removed)."""
    full = gather_from_tensor_model_parallel_region(local.float(), model.ps.tp)
    return torch.log_softmax(full[..., :model.config.vocab_size], dim=-1)


class TokenScores:
    """Per row of a batch: ``logprobs[r]`` the log-probability of each recorded token
    (floats), and with ``top_n`` > 0 ``top[r]`` the ``top_n`` most likely tokens at each
    recorded position, as (ids, log-probs) most likely first."""

    def __init__(self, rows: int, top_n: int = 0):
        self.top_n = top_n
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.top: list[list[tuple[list[int], list[float]]]] = [[] for _ in range(rows)]

    def _take(self, row: int, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        """``logprobs`` fp32 ``[n, V]`` of ``n`` positions, ``targets`` int64 ``[n]``."""
        picked = logprobs.gather(-1, targets.view(-1, 1).to(logprobs.device)).view(-1)
        self.logprobs[row].extend(picked.tolist())
        if self.top_n:
            values, ids = torch.topk(logprobs, min(self.top_n, logprobs.shape[-1]), dim=-1)
            self.top[row].extend(zip(ids.tolist(), values.tolist()))

    def add(self, model, logits: torch.Tensor, targets: torch.Tensor,
            spans: list[tuple[int, int] | None]) -> None:
        """Record positions ``spans[r] = (start, end)`` of row ``r`` (None: none) of this
        rank's logits ``[b, s, V_padded/tp]``, each scoring ``targets[r, j]`` (int64
        ``[b, s]``: the token that followed position ``j``). Collective over tp: every tp
        rank of the last stage calls it with the same spans."""
        if logits.shape[1] == 1:   # a decoding step: one gather for the whole batch
            logprobs = full_log_softmax(model, logits[:, 0])
            for r, span in enumerate(spans):
                if span is not None and span[1] > span[0]:
                    self._take(r, logprobs[r:r + 1], targets[r, :1])
            return
        for r, span in enumerate(spans):
            if span is None:
                continue
            for j in range(span[0], span[1], POSITIONS_PER_CHUNK):
                k = min(span[1], j + POSITIONS_PER_CHUNK)
                self._take(r, full_log_softmax(model, logits[r, j:k]), targets[r, j:k])

    def share(self, model) -> TokenScores:
        """The last pipeline stage's records on every stage (in place)."""
        self.logprobs, self.top = from_last_stage(model, (self.logprobs, self.top))
        return self


@torch.no_grad()
def score_batch(model, prompts: list[list[int]], top_n: int = 0,
                pad_id: int = 0) -> TokenScores:
    """The log-probability of every token after the first of each prompt (and the
    ``top_n`` most likely tokens at those positions), from one forward of the left-padded
    batch: row ``r`` gets ``len(prompts[r]) - 1`` entries. Collective over the model's
    ranks (every rank passes the same prompts); every rank gets the scores."""
    from megalite.inference.generation import check_prompt

    cfg = model.config
    for prompt in prompts:
        check_prompt(prompt, cfg, generating=False)
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * n + p for n, p in zip(pads, prompts)], dtype=torch.int64,
                       device=device)  # [b, width]
    was_training = model.training
    model.eval()
    try:
        if len(prompts) > 1:
            cache = InferenceCache(width, torch.tensor(pads, dtype=torch.int64))
            pos = cache.position_ids(len(prompts), width, device)
            logits = stage_forward(model, ids, pos, cache)
        else:
            logits = stage_forward(model, ids)
        scores = TokenScores(len(prompts), top_n)
        if logits is not None:
            targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the last column unused
            scores.add(model, logits, targets, [(n, width - 1) for n in pads])
    finally:
        model.train(was_training)
    return scores.share(model)
