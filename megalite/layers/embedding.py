"""Vocabulary-parallel embedding: each TP rank holds a contiguous slice of the rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.layers.linear import _divide
from megalite.parallel.params import mark_param
from megalite.parallel import mappings


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows held by ``tp_rank``."""
    per_rank = _divide(padded_vocab_size, tp_size, "padded vocabulary size")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(partial, self.tp_group)
