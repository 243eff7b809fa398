"""Vocab-parallel cross entropy computed in chunks of tokens (``--cross-entropy-loss-fusion``).

The same loss and gradient as :mod:`megalite.layers.cross_entropy` (same formula, same
two all-reduces over the TP group, padded vocabulary masked, ``ignore_index`` tokens with
loss 0 and no gradient), but the fp32 softmax of the logits ``[tokens, V/tp]`` is never
whole in memory:

* forward: one pass over the logits, ``chunk_rows`` tokens at a time (upcast to fp32 per
  chunk): the chunk's max and ``sum_v exp(z_v - max)`` ("online softmax"), then under tp
  the MAX all-reduce and each rank's sums rescaled to the global max before the sum
  all-reduce. Saved for backward: the logits as they came (compute dtype), and the global
  max and sum of exponentials, fp32 ``[tokens]`` each.
* backward: chunk by chunk the softmax is recomputed from the saved logits and
  ``(softmax - onehot) * grad_loss`` is written, in the logits' dtype, *over the saved
  logits*, which then are the gradient. So after backward the logits passed in hold their
  gradient: do not read them afterwards, and call backward once.

Memory, for ``N`` tokens and ``V`` = vocab / tp: the default path holds an fp32 ``[N, V]``
copy next to the logits during forward and saves it (the softmax) for backward; here
forward needs one fp32 chunk ``[chunk_rows, V]`` beyond the logits, backward the same
(none for fp32 logits, whose chunks are overwritten in place), and what is saved is the
logits in their dtype (half the default's saved bytes in bf16, and a peak of about a
third). On CPU the chunks are small enough to stay in cache (:func:`default_chunk_rows`),
so each phase reads the logits from memory about once: faster than the default path.
"""

from __future__ import annotations

import torch

from megalite.layers.cross_entropy import local_targets, loss_from_parts, valid_vocab
from megalite.parallel.collectives import ReduceOp, all_reduce

CHUNK_ELEMENTS = 1 << 22  # fp32 elements per chunk on accelerators (16 MiB): few launches
CPU_CHUNK_ELEMENTS = 1 << 18  # on CPU (1 MiB): a chunk stays in cache across its passes


def default_chunk_rows(local_vocab: int, device: torch.device | str | None = None) -> int:
    """Tokens per chunk so that one fp32 chunk holds about ``CHUNK_ELEMENTS`` values
    (``CPU_CHUNK_ELEMENTS`` on a CPU ``device``)."""
    cpu = device is not None and torch.device(device).type == "cpu"
    return max(1, (CPU_CHUNK_ELEMENTS if cpu else CHUNK_ELEMENTS) // max(1, local_vocab))


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, padded_vocab_size, vocab_size, ignore_index,
                chunk_rows):
        local_vocab = logits.shape[-1]
        start, n_valid = valid_vocab(local_vocab, padded_vocab_size, vocab_size, tp_group)
        flat = logits.reshape(-1, local_vocab)          # [N, V/tp], a view when contiguous
        flat_target = target.reshape(-1)
        local_target, outside = local_targets(flat_target, start, local_vocab)

        # one pass over the logits ("online softmax"): per chunk of rows, the local max and
        # the sum of exponentials relative to it, read while the chunk is in cache
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
        local_max = flat.new_full(flat.shape[:1], float("-inf"), dtype=torch.float32)
        sum_exp = torch.zeros_like(local_max)
        if n_valid > 0:
            for rows in _chunks(flat.shape[0], chunk_rows):
                chunk = flat[rows, :n_valid]
                chunk_max = chunk.max(dim=-1).values.float()
                local_max[rows] = chunk_max
                sum_exp[rows] = (chunk.float() - chunk_max.unsqueeze(-1)).exp_().sum(dim=-1)
        logits_max = local_max
        if tp_group.size > 1:  # rescale to the global max (MAX all-reduce over tp_group)
            logits_max = local_max.clone()
            all_reduce(logits_max, tp_group, ReduceOp.MAX)
            rescale = (local_max - logits_max).exp_().masked_fill_(local_max == float("-inf"), 0)
            sum_exp.mul_(rescale)
        target_logit = (target_logit - logits_max).masked_fill_(outside, 0.0)
        ignored = flat_target == ignore_index
        loss, sum_exp = loss_from_parts(target_logit, sum_exp, ignored, tp_group)
        ctx.save_for_backward(flat, logits_max, sum_exp, local_target, outside, ignored)
        ctx.shape, ctx.n_valid, ctx.chunk_rows = logits.shape, n_valid, chunk_rows
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        flat, logits_max, sum_exp, local_target, outside, ignored = ctx.saved_tensors
        n_valid = ctx.n_valid
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        hit = (~outside).float()
        for rows in _chunks(flat.shape[0], ctx.chunk_rows):
            chunk = flat[rows]
            grad = chunk.float()  # fp32 logits: the chunk itself, overwritten in place
            valid = grad[:, :n_valid]
            valid.sub_(logits_max[rows].unsqueeze(-1)).exp_()
            valid.div_(sum_exp[rows].unsqueeze(-1))                      # softmax
            grad[:, n_valid:] = 0.0
            grad.scatter_add_(-1, local_target[rows].unsqueeze(-1), -hit[rows].unsqueeze(-1))
            grad.mul_(scale[rows].unsqueeze(-1))
            if grad.data_ptr() != chunk.data_ptr():
                chunk.copy_(grad)                                        # over the logits
        return flat.view(ctx.shape), None, None, None, None, None, None


def _chunks(n: int, size: int):
    return (slice(i, min(i + size, n)) for i in range(0, n, size))


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group,
                                         *, vocab_size: int, ignore_index: int = -100,
                                         chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token loss, fp32 ``[...]``, from this rank's logits ``[..., padded_vocab/tp]``
    and the global target ids ``[...]``; collectives over ``tp_group`` (one max and one
    sum all-reduce). ``chunk_rows`` tokens are upcast at a time (default
    :func:`default_chunk_rows`). Backward overwrites ``logits`` with their gradient.
    """
    padded = logits.shape[-1] * tp_group.size
    rows = chunk_rows or default_chunk_rows(logits.shape[-1], logits.device)
    return _ChunkedVocabParallelCrossEntropy.apply(logits, target, tp_group, padded,
                                                   vocab_size, ignore_index, rows)
