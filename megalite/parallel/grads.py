"""Gradient reductions that tensor/sequence parallelism adds on top of data parallelism."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    """SUM ``tensors`` over ``group`` in place, through one flat buffer per dtype.

    ``group`` is a :class:`~megalite.parallel.state.Group`; a no-op with one member.
    """
    if group.size == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group.group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> None:
    """Sum ``.grad`` over ``tp_group`` for parameters marked ``sequence_parallel``.

    Under sequence parallelism a replicated parameter (norm weights and biases,
    row-parallel biases, learned position embeddings) sees only this rank's ``s/tp``
    tokens, so its gradient is partial. Call after backward, before the data-parallel
    reduction. ``tp_group`` is a :class:`~megalite.parallel.state.Group` (``pstate.tp``);
    a no-op when it has one member.
    """
    all_reduce_coalesced([p.grad for p in params
                          if getattr(p, "sequence_parallel", False) and p.grad is not None],
                         tp_group)
