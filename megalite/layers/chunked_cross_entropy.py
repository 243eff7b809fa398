"""Vocab-parallel cross entropy computed in chunks of tokens (``--cross-entropy-loss-fusion``).

The same loss and gradient as :mod:`megalite.layers.cross_entropy` (same formula, same
two all-reduces over the TP group, padded vocabulary masked, ``ignore_index`` tokens with
loss 0 and no gradient), but the fp32 softmax of the logits ``[tokens, V/tp]`` is never
whole in memory:

* forward: the max over the vocabulary is taken in the logits' dtype (exact), then
  ``chunk_rows`` tokens at a time are upcast to fp32 to add up ``sum_v exp(z_v - m)`` and
  pick the target logit. Saved for backward: the logits as they came (compute dtype), and
  ``m`` and the sum of exponentials, fp32 ``[tokens]`` each.
* backward: chunk by chunk the softmax is recomputed from the saved logits and
  ``(softmax - onehot) * grad_loss`` is written, in the logits' dtype, *over the saved
  logits*, which then are the gradient. So after backward the logits passed in hold their
  gradient: do not read them afterwards, and call backward once.

Memory, for ``N`` tokens and ``V`` = vocab / tp: the default path holds an fp32 ``[N, V]``
copy next to the logits during forward and saves it (the softmax) for backward; here
forward needs one fp32 chunk ``[chunk_rows, V]`` beyond the logits, backward the same,
and what is saved is the logits in their dtype (half the default's saved bytes in bf16,
and a peak of about a third).
"""

from __future__ import annotations

import torch

from megalite.layers.cross_entropy import (
    global_logits_max,
    local_targets,
    loss_from_parts,
    valid_vocab,
)

CHUNK_ELEMENTS = 1 << 22  # fp32 elements per chunk by default (16 MiB)


def default_chunk_rows(local_vocab: int) -> int:
    """Tokens per chunk so that one fp32 chunk holds about ``CHUNK_ELEMENTS`` values."""
    return max(1, CHUNK_ELEMENTS // max(1, local_vocab))


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, padded_vocab_size, vocab_size, ignore_index,
                chunk_rows):
        local_vocab = logits.shape[-1]
        start, n_valid = valid_vocab(local_vocab, padded_vocab_size, vocab_size, tp_group)
        flat = logits.reshape(-1, local_vocab)          # [N, V/tp], a view when contiguous
        flat_target = target.reshape(-1)
        logits_max = global_logits_max(flat, n_valid, tp_group)

        local_target, outside = local_targets(flat_target, start, local_vocab)
        sum_exp = torch.empty_like(logits_max)
        target_logit = torch.empty_like(logits_max)
        for rows in _chunks(flat.shape[0], chunk_rows):
            shifted = _shifted(flat[rows], logits_max[rows], n_valid)
            target_logit[rows] = shifted.gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1)
            sum_exp[rows] = shifted.exp_().sum(dim=-1)
        target_logit.masked_fill_(outside, 0.0)
        ignored = flat_target == ignore_index
        loss, sum_exp = loss_from_parts(target_logit, sum_exp, ignored, tp_group)
        ctx.save_for_backward(flat, logits_max, sum_exp, local_target, outside, ignored)
        ctx.shape, ctx.n_valid, ctx.chunk_rows = logits.shape, n_valid, chunk_rows
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        flat, logits_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        hit = (~outside).float()
        for rows in _chunks(flat.shape[0], ctx.chunk_rows):
            grad = _shifted(flat[rows], logits_max[rows], ctx.n_valid).exp_()
            grad.div_(sum_exp[rows].unsqueeze(-1))                       # softmax
            grad.scatter_add_(-1, local_target[rows].unsqueeze(-1), -hit[rows].unsqueeze(-1))
            grad.mul_(scale[rows].unsqueeze(-1))
            flat[rows] = grad                                            # over the logits
        return flat.view(ctx.shape), None, None, None, None, None, None


def _chunks(n: int, size: int):
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def _shifted(chunk: torch.Tensor, logits_max: torch.Tensor, n_valid: int) -> torch.Tensor:
    """fp32 ``chunk - max`` ``[rows, V/tp]``, padded vocabulary entries at -inf."""
    shifted = chunk.float() - logits_max.unsqueeze(-1)
    if n_valid < chunk.shape[-1]:
        shifted[:, n_valid:] = float("-inf")
    return shifted


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group,
                                         *, vocab_size: int, ignore_index: int = -100,
                                         chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token loss, fp32 ``[...]``, from this rank's logits ``[..., padded_vocab/tp]``
    and the global target ids ``[...]``; collectives over ``tp_group`` (one max and one
    sum all-reduce). ``chunk_rows`` tokens are upcast at a time (default
    :func:`default_chunk_rows`). Backward overwrites ``logits`` with their gradient.
    """
    padded = logits.shape[-1] * tp_group.size
    rows = chunk_rows or default_chunk_rows(logits.shape[-1])
    return _ChunkedVocabParallelCrossEntropy.apply(logits, target, tp_group, padded,
                                                   vocab_size, ignore_index, rows)
