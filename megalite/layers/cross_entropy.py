"""Cross entropy over vocabulary-sharded logits, without gathering the full logits.

For logits ``z`` split over the TP group by vocabulary and target ``t``::

    loss = log(sum_v exp(z_v - m)) - (z_t - m),     m = max_v z_v

Each rank computes its local max, sum of exponentials and (if it holds ``t``) the target
logit; three scalars per token cross the group (one max all-reduce, one sum all-reduce),
never the ``[s, b, V]`` logits. Padded vocabulary entries (ids >= ``vocab_size``) are
masked to -inf, so they get zero probability and the model does not depend on the padding
(a tp=4 run trains the same model as tp=1). Targets equal to ``ignore_index`` get loss 0
and no gradient. Softmax and loss are computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch

from megalite.layers.embedding import vocab_range
from megalite.parallel.collectives import ReduceOp, all_reduce


def valid_vocab(local_vocab: int, padded_vocab_size: int, vocab_size: int,
                tp_group) -> tuple[int, int]:
    """(first vocabulary id of this rank's ``local_vocab`` columns, how many of them are
    real ids rather than padding)."""
    start, _ = vocab_range(padded_vocab_size, tp_group.rank, tp_group.size)
    return start, max(0, min(local_vocab, vocab_size - start))


def global_logits_max(logits: torch.Tensor, n_valid: int, tp_group) -> torch.Tensor:
    """fp32 ``[...]``: the max of ``logits`` ``[..., V/tp]`` over the real vocabulary of
    every rank (this rank's first ``n_valid`` columns, then MAX all-reduce over
    ``tp_group``)."""
    if n_valid > 0:
        logits_max = logits[..., :n_valid].max(dim=-1).values.float()
    else:
        logits_max = logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
    if tp_group.size > 1:
        all_reduce(logits_max, tp_group, ReduceOp.MAX)
    return logits_max


def local_targets(target: torch.Tensor, start: int, local_vocab: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(target ids as columns of this rank's slice, 0 where outside it; the outside mask)."""
    outside = (target < start) | (target >= start + local_vocab)
    return (target - start).masked_fill(outside, 0), outside


def loss_from_parts(target_logit: torch.Tensor, sum_exp: torch.Tensor, ignored: torch.Tensor,
                    tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum this rank's shifted target logits (0 where the target is elsewhere) and sums of
    exponentials over ``tp_group`` (one all-reduce), and return (per-token loss, ignored
    tokens at 0; the global sum of exponentials)."""
    if tp_group.size > 1:
        both = torch.stack([target_logit, sum_exp])
        all_reduce(both, tp_group)
        target_logit, sum_exp = both[0], both[1]
    return (sum_exp.log() - target_logit).masked_fill(ignored, 0.0), sum_exp


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, padded_vocab_size, vocab_size, ignore_index):
        local_vocab = logits.shape[-1]
        start, n_valid = valid_vocab(local_vocab, padded_vocab_size, vocab_size, tp_group)
        logits_max = global_logits_max(logits, n_valid, tp_group)

        shifted = logits.float() - logits_max.unsqueeze(-1)  # a new fp32 tensor
        if n_valid < local_vocab:
            shifted[..., n_valid:] = float("-inf")

        local_target, outside = local_targets(target, start, local_vocab)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        probs = shifted.exp_()
        ignored = target == ignore_index
        loss, sum_exp = loss_from_parts(target_logit, probs.sum(dim=-1), ignored, tp_group)
        probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local_target, outside, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d z = softmax(z) - onehot(t); computed in place on the saved softmax.
        probs, local_target, outside, ignored = ctx.saved_tensors
        grad = probs
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        scale = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group, *,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss, fp32 ``[...]``, from this rank's logits ``[..., padded_vocab/tp]``
    and the global target ids ``[...]``; collectives over ``tp_group``.

    ``vocab_size`` is the real vocabulary; logits beyond it are padding and excluded.
    The backward pass reuses the saved softmax in place (call backward once).
    """
    padded = logits.shape[-1] * tp_group.size
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, padded, vocab_size,
                                            ignore_index)
