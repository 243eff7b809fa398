"""Gradient reductions that tensor/sequence parallelism adds on top of data parallelism."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megalite.parallel.collectives import all_reduce_coalesced
from megalite.parallel.params import param_meta


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> None:
    """Sum ``.grad`` over ``tp_group`` for parameters marked ``sequence_parallel``.

    Under sequence parallelism a replicated parameter (norm weights and biases,
    row-parallel biases, learned position embeddings) sees only this rank's ``s/tp``
    tokens, so its gradient is partial. Call after backward, before the data-parallel
    reduction. ``tp_group`` is a :class:`~megalite.parallel.state.Group` (``ps.tp``);
    a no-op when it has one member.
    """
    all_reduce_coalesced([p.grad for p in params
                          if param_meta(p).sequence_parallel and p.grad is not None],
                         tp_group)
