"""What the generation server does with one accepted request, apart from HTTP: the job
that every rank of the model runs (:class:`GenerationJob`, built on the serving rank by
:func:`make_job` and broadcast to the others), and the answer in Megatron-LM's shapes
(:func:`answer`).

The answer, for a request of ``B`` prompts, row ``i`` holding ``n_i`` tokens (prompt, with
the bos that ``add_BOS`` put first, then the new tokens, a final end-of-document
included)::

    text            [B] str: the row's tokens detokenized (a final end-of-document left out)
    tokens          [B][n_i] int
    segments        [B][n_i] str: each token's piece of ``text``; they join to ``text``
                    (a final end-of-document's piece is "")
    logprobs        [B][n_i - 1] float, with ``logprobs``: the log-probability of each
                    token after the first given those before it
    top_n_logprobs  [B][n_i - 1] {token text: log-prob}, with ``top_n_logprobs`` n: the n
                    most likely tokens at each of those positions, most likely first

``tokens_to_generate`` 0 scores the prompts in one forward and generates nothing (a
prompt may then fill the whole sequence length), as a log-likelihood evaluation asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megalite.inference.api_request import ApiRequest, RequestError
from megalite.inference.generation import generate_batch
from megalite.inference.sampling import SamplingParams
from megalite.inference.scoring import DecodeRules, TokenScores, score_batch


@dataclass
class GenerationJob:
    """One request in token ids, as every rank of the model runs it."""

    prompts: list[list[int]]
    tokens_to_generate: int
    params: SamplingParams
    seed: int
    eod: int
    rules: DecodeRules
    logprobs: bool = False
    top_n: int = 0


@dataclass
class JobResult:
    """The new tokens of each row, and (when asked) its scores."""

    new: list[list[int]]
    scores: TokenScores | None = None


def run_job(model, job: GenerationJob) -> JobResult:
    """Generate (or, with 0 tokens to generate, score) ``job`` on this rank; collective
    over the model's ranks, which all run the same job."""
    if job.tokens_to_generate == 0:
        scores = score_batch(model, job.prompts, job.top_n, pad_id=job.eod)
        return JobResult([[] for _ in job.prompts], scores)
    scores = TokenScores(len(job.prompts), job.top_n) if (job.logprobs or job.top_n) else None
    new = generate_batch(model, job.prompts, job.tokens_to_generate, job.params, eod=job.eod,
                         generator=torch.Generator().manual_seed(job.seed), rules=job.rules,
                         scores=scores)
    return JobResult(new, scores)


def single_token(tokenizer, text: str) -> int | None:
    """The id of the one token that is ``text`` (a bos the tokenizer puts first ignored),
    or None when the tokenizer has none."""
    try:
        ids = tokenizer.tokenize(text)
    except (ValueError, KeyError):   # e.g. NullTokenizer reads only integers
        return None
    for token in ids:
        if tokenizer.detokenize([token]) == text:
            return int(token)
    return None


def bos_id(tokenizer) -> int:
    """The token ``add_BOS`` puts first: the tokenizer's bos, else (as Megatron-LM does)
    its end-of-document token."""
    for owner, name in ((tokenizer, "bos"), (getattr(tokenizer, "_tok", None), "bos_token_id")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and 0 <= value < tokenizer.vocab_size:
            return value
    return tokenizer.eod


def _needed(tokenizer, text: str, field: str) -> int:
    token = single_token(tokenizer, text)
    if token is None:
        raise RequestError(f"{field}: the tokenizer has no single token for {text!r}")
    return token


def make_rules(tokenizer, request: ApiRequest) -> DecodeRules:
    """The request's stop tokens and banned tokens in ids (400 when the tokenizer lacks a
    token that a field needs, or ``stop_token`` is outside the vocabulary)."""
    rules = DecodeRules(stop_on_eol=request.stop_on_eol,
                        stop_on_double_eol=request.stop_on_double_eol)
    if request.stop_token is not None:
        if request.stop_token >= tokenizer.vocab_size:
            raise RequestError(f"stop_token must be a token id in [0, {tokenizer.vocab_size})"
                               f", got {request.stop_token}")
        rules.stop_ids = (request.stop_token,)
    if request.stop_on_eol or request.stop_on_double_eol or \
            request.prevent_newline_after_colon:
        field = next(name for name in ("stop_on_eol", "stop_on_double_eol",
                                       "prevent_newline_after_colon")
                     if getattr(request, name))
        rules.newline = _needed(tokenizer, "\n", field)
        rules.double_newline = single_token(tokenizer, "\n\n")
    if request.prevent_newline_after_colon:
        colon = _needed(tokenizer, ":", "prevent_newline_after_colon")
        rules.banned_after = {colon: tuple(t for t in (rules.newline, rules.double_newline)
                                           if t is not None)}
    return rules


def segments(tokenizer, tokens: list[int], text: str, window: int = 8) -> list[str]:
    """Each token's piece of ``text`` (the detokenized ``tokens``, perhaps without a final
    end-of-document): what detokenizing it adds to the ``window`` tokens before it, kept
    where ``text`` goes on with it; a token whose piece is not there yet (a partial UTF-8
    character) gets "" and the next one takes the text. The pieces join to ``text``."""
    pieces, at = [], 0
    for k in range(len(tokens)):
        start = max(0, k - window)
        before = tokenizer.detokenize(tokens[start:k]) if k > start else ""
        after = tokenizer.detokenize(tokens[start:k + 1])
        same = 0
        for a, b in zip(before, after):
            if a != b:
                break
            same += 1
        piece = after[same:]
        if piece and text.startswith(piece, at):
            pieces.append(piece)
            at += len(piece)
        else:
            pieces.append("")
    if at < len(text):   # text no piece claimed (a tokenizer that is not concatenative)
        last = max((i for i, p in enumerate(pieces) if p), default=len(pieces) - 1)
        pieces[last] += text[at:]
    return pieces


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -1e30   # JSON has no -Infinity


def _top_dict(tokenizer, ids: list[int], values: list[float]) -> dict[str, float]:
    """{token text: log-prob}, most likely first; tokens of the same text keep the more
    likely one's."""
    out: dict[str, float] = {}
    for token, value in zip(ids, values):
        out.setdefault(tokenizer.detokenize([token]), _finite(value))
    return out


def answer(tokenizer, request: ApiRequest, job: GenerationJob, result: JobResult) -> dict:
    """The JSON answer (the module docstring's fields) of a finished job."""
    rows = [p + o for p, o in zip(job.prompts, result.new)]
    texts, pieces = [], []
    for row, new in zip(rows, result.new):
        shown = row[:-1] if new[-1:] == [job.eod] else row
        text = tokenizer.detokenize(shown)
        texts.append(text)
        pieces.append(segments(tokenizer, shown, text) + [""] * (len(row) - len(shown)))
    out = {"text": texts, "segments": pieces, "tokens": rows}
    if result.scores is not None and request.logprobs:
        out["logprobs"] = [[_finite(v) for v in lp] for lp in result.scores.logprobs]
    if result.scores is not None and request.top_n_logprobs:
        out["top_n_logprobs"] = [[_top_dict(tokenizer, ids, values) for ids, values in row]
                                 for row in result.scores.top]
    return out
