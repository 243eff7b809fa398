"""Vocabulary-parallel embedding: each TP rank holds a contiguous slice of the rows.

The lookup's backward (:class:`_EmbeddingLookup`) builds the dense table gradient
``[V/tp, h]`` as PyTorch's does (zeros, then each token's row added in token order: the
same values bit for bit) but in memory it keeps: a table-sized gradient allocated fresh every
backward costs, on CPU, a page fault per 4 KiB (glibc maps such blocks anew each time, and
a 32000 x 512 fp32 table takes about six times as long to zero fresh as reused). The
buffer is handed to autograd (which makes it ``weight.grad``); it is reused only once
nothing else holds it (``weight.grad`` dropped, by ``zero_grad`` or a gradient buffer's
hook), else a new one is allocated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.layers.linear import _divide
from megalite.layers.reused_buffer import ReusedGradBuffer
from megalite.parallel.params import mark_param
from megalite.parallel import mappings
from megalite.parallel import weight_grad


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows held by ``tp_rank``."""
    per_rank = _divide(padded_vocab_size, tp_size, "padded vocabulary size")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class _EmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient lands in ``buffer``."""

    @staticmethod
    def forward(ctx, ids, weight, buffer):
        ctx.save_for_backward(ids)
        # the weight itself (not its values: no saved-tensor version check) for a W step
        # to accumulate into
        ctx.buffer, ctx.weight = buffer, weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        buffer, weight = ctx.buffer, ctx.weight

        def compute():
            shape = (weight.shape, grad.dtype, grad.device)
            dense = buffer.zeros(*shape) if buffer is not None else torch.zeros(*shape)
            return dense.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        # a split backward (zero-bubble schedules) defers it to the W step, after the
        # output layer's gradient of the same weight when the two are tied, as fused
        return None, weight_grad.weight_grad(weight, compute), None


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor,
                     buffer: ReusedGradBuffer | None = None) -> torch.Tensor:
    """Rows of ``weight`` ``[V, h]`` at ``ids`` ``[...]`` -> ``[..., h]``, equal to
    ``F.embedding`` in values and gradient; with ``buffer`` the weight gradient reuses
    its storage (see :class:`ReusedGradBuffer`). Under ``torch.compile`` or double
    backward it is plain ``F.embedding``; inside ``weight_grad.splittable()`` (a
    zero-bubble schedule's forward) its gradient may be deferred to a W step."""
    if ((buffer is None and not weight_grad.split_enabled(weight.device.type))
            or not weight.requires_grad
            or torch.compiler.is_compiling() or not torch.is_grad_enabled()):
        return F.embedding(ids, weight)
    return _EmbeddingLookup.apply(ids, weight, buffer)


class VocabParallelEmbedding(torch.nn.Module):
    """Token ids ``[s, b]`` -> embeddings ``[s, b, h]`` (``[s/tp, b, h]`` with
    ``sequence_parallel``).

    The table ``[padded_vocab/tp, h]`` is sharded on dim 0 over ``ps.tp``;
    ``padded_vocab_size`` is ``ModelConfig.padded_vocab_size(tp)``, and the padding rows
    (ids >= ``vocab_size``) are zero and excluded from the layout-invariant full tensor.
    Each rank looks up the ids in its range, zeros the others, and the partial results are
    summed over ``ps.tp`` (all-reduce, or reduce-scatter along the sequence under
    sequence parallelism).
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, *, vocab_size: int,
                 ps, sequence_parallel: bool = False, init_std: float = 0.02,
                 device=None, dtype=None):
        super().__init__()
        if vocab_size > padded_vocab_size:
            raise ValueError(f"vocab_size ({vocab_size}) exceeds the padded size "
                             f"({padded_vocab_size})")
        self.tp_group = tp_group = ps.tp
        device = ps.device if device is None else device
        self.sequence_parallel = sequence_parallel
        self.vocab_start, self.vocab_end = vocab_range(padded_vocab_size, tp_group.rank,
                                                       tp_group.size)
        local = self.vocab_end - self.vocab_start
        self.weight = mark_param(
            torch.nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=dtype)),
            partition_dim=0, unpadded_size=vocab_size, init_std=init_std)
        # kept gradient storage on CPU only (a GPU's caching allocator reuses storage)
        self._grad_buffer = ReusedGradBuffer() if torch.device(device).type == "cpu" else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return embedding_lookup(ids, self.weight, self._grad_buffer)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = embedding_lookup(local_ids, self.weight, self._grad_buffer)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)
