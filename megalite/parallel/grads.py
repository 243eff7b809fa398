"""Gradient reductions that tensor/sequence parallelism adds on top of data parallelism."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> None:
    """Sum ``.grad`` over ``tp_group`` for parameters marked ``sequence_parallel``.

    Under sequence parallelism a replicated parameter (norm weights and biases,
    row-parallel biases, learned position embeddings) sees only this rank's ``s/tp``
    tokens, so its gradient is partial. Call after backward, before the data-parallel
    reduction. ``tp_group`` is a :class:`~megalite.parallel.state.Group` (``pstate.tp``);
    a no-op when it has one member. Grads are flattened into one buffer per dtype.
    """
    if tp_group.size == 1:
        return
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, group=tp_group.group)
        offset = 0
        for g in group:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
