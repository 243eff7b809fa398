"""Collectives of the token dispatchers: uneven all-to-all and uneven gather/scatter.

Every function takes a :class:`megalite.parallel.state.Group` (``ps.ep`` for the
expert-parallel exchange, ``ps.etp`` for expert tensor parallelism) and is the
identity when the group has one member. Uneven sizes go through ``all_to_all_single``
with explicit split sizes (gloo rejects the list form of ``all_to_all`` when sizes differ),
so the sizes must be known on both sides first: :func:`exchange_counts` sends them. The raw
(non-autograd) exchanges are in :mod:`megalite.parallel.collectives` and the autograd
all-to-all in :func:`megalite.parallel.mappings.all_to_all`, which the dispatch calls with
an exchange that runs asynchronously inside a pair of :mod:`megalite.parallel.paired_lanes`
(``--overlap-moe-expert-parallel-comm``) and is timed; this module adds that exchange, the
uneven gather/scatter adjoints and the traffic accounting.

Each autograd function is paired with its adjoint in backward:

=====================  =======================================  ==========================
function               forward                                  backward
=====================  =======================================  ==========================
all_to_all             rows ``send[r]`` go to rank r            the reverse all-to-all
gather_uneven          every rank gets all ranks' rows          sum of the row block that
                       (rank order), counts may differ          came from this rank
=====================  =======================================  ==========================

:class:`CommCounter` records the bytes each forward collective sends to *other* ranks, so
the benchmark can compare the dispatchers' traffic with theory. Backward moves the same
bytes in the opposite direction and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megalite.parallel import collectives, mappings, paired_lanes


@dataclass
class CommCounter:
    """Bytes sent to other ranks by forward collectives, by name (``dispatch``, ...)."""

    sent: dict = field(default_factory=dict)

    def add(self, name: str, nbytes: int) -> None:
        self.sent[name] = self.sent.get(name, 0) + int(nbytes)

    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self) -> None:
        self.sent.clear()


def _row_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of ``x`` ``[rows, ...]``, also when it has no rows (an
    expert-parallel rank that receives no token)."""
    return math.prod(x.shape[1:]) * x.element_size()


def _raw_all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int],
                    group) -> torch.Tensor:
    return collectives.all_to_all(x, group, send, recv)


def exchange_counts(counts: torch.Tensor, group,
                    counter: CommCounter | None = None) -> torch.Tensor:
    """All-to-all of equal-size count blocks over ``group`` (no autograd).

    ``counts`` ``[n, ...]`` (int64), block r = ``counts[r]`` goes to rank r; returns
    ``[n, ...]`` where row r came from rank r. Identity when ``group.size == 1``.
    """
    if group.size == 1:
        return counts
    out = collectives.all_to_all(counts, group)
    if counter is not None:
        counter.add("counts", counts[0].numel() * counts.element_size() * (group.size - 1))
    return out


def all_gather_stacked(x: torch.Tensor, group,
                       counter: CommCounter | None = None, name: str = "counts"
                       ) -> torch.Tensor:
    """``x`` ``[m, ...]`` on each rank -> ``[n, m, ...]``, row r from rank r (no autograd)."""
    if group.size == 1:
        return x.unsqueeze(0)
    out = collectives.all_gather_dim0(x, group)  # gloo wants dim 0 stacked
    out = out.view(group.size, *x.shape)
    if counter is not None:
        counter.add(name, x.numel() * x.element_size() * (group.size - 1))
    return out


def _gather_rows(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Uneven all-gather: every rank sends its rows to everyone (rank order)."""
    mine = sizes[group.rank]
    return _raw_all_to_all(x.repeat(group.size, *([1] * (x.dim() - 1))),
                           [mine] * group.size, sizes, group)


def _reduce_rows(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Uneven reduce-scatter: block r of ``x`` goes to rank r, which sums what it gets."""
    n, mine = group.size, sizes[group.rank]
    back = _raw_all_to_all(x, sizes, [mine] * n, group)
    return back.view(n, mine, *x.shape[1:]).sum(0)


class _GatherUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_rows(grad, ctx.sizes, ctx.group), None, None


class _ReduceUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.sizes, ctx.group), None, None


def _lane_all_to_all(x: torch.Tensor, group, send, recv, side=None) -> torch.Tensor:
    """The uneven all-to-all: launched asynchronously and left running while ``side``
    (a :class:`megalite.moe.shared_overlap.SideJob`'s ``run``: the shared experts under
    ``--moe-shared-expert-overlap``) computes and, inside a pair of
    :mod:`megalite.parallel.paired_lanes` (``--overlap-moe-expert-parallel-comm``), while
    the other micro-batch computes; blocking without either. Timed either way."""
    if paired_lanes.active() or side is not None:
        return paired_lanes.exchange(
            lambda: collectives.all_to_all_async(x, group, send, recv), side=side)
    return paired_lanes.timed(lambda: collectives.all_to_all(x, group, send, recv))


def all_to_all(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group,
               counter: CommCounter | None = None, name: str = "all_to_all",
               side=None) -> torch.Tensor:
    """Uneven all-to-all of rows over ``group`` (``all_to_all_single``).

    ``x`` ``[sum(send), ...]``: its first ``send[0]`` rows go to rank 0, the next
    ``send[1]`` to rank 1, ...; returns ``[sum(recv), ...]``, ``recv[r]`` rows from rank r
    in rank order. Backward is the reverse exchange. Counts rows sent to other ranks.
    ``side``: a :class:`megalite.moe.shared_overlap.SideJob` the forward exchange runs
    while in flight (not run when ``group`` has one member: the caller takes it after).
    """
    if group.size == 1:
        return x
    if counter is not None:
        counter.add(name, (sum(send) - send[group.rank]) * _row_bytes(x))
    return mappings.all_to_all(x, group, send, recv, exchange=_lane_all_to_all,
                               side=None if side is None else side.run)


def gather_uneven(x: torch.Tensor, sizes: Sequence[int], group,
                  counter: CommCounter | None = None, name: str = "gather"
                  ) -> torch.Tensor:
    """All-gather rows of uneven counts over ``group``: ``x`` ``[sizes[rank], ...]`` ->
    ``[sum(sizes), ...]`` (rank order). Backward sums the gradient of this rank's block
    over every rank (an uneven reduce-scatter)."""
    if group.size == 1:
        return x
    if counter is not None:
        counter.add(name, x.shape[0] * (group.size - 1) * _row_bytes(x))
    return _GatherUneven.apply(x, list(sizes), group)


def scatter_reduce_uneven(x: torch.Tensor, sizes: Sequence[int], group,
                          counter: CommCounter | None = None, name: str = "reduce_scatter"
                          ) -> torch.Tensor:
    """Adjoint of :func:`gather_uneven`: ``x`` ``[sum(sizes), ...]`` partial sums on every
    rank -> this rank's block ``[sizes[rank], ...]`` summed over ``group``. Backward
    all-gathers the gradient blocks."""
    if group.size == 1:
        return x
    if counter is not None:
        counter.add(name, (x.shape[0] - sizes[group.rank]) * _row_bytes(x))
    return _ReduceUneven.apply(x, list(sizes), group)


def sort_chunks_index(sizes: torch.Tensor) -> torch.Tensor:
    """Row index that regroups chunks laid out ``[a, b]`` (a slower) as ``[b, a]``.

    ``sizes`` ``[A, B]`` (CPU int64): the rows of ``x`` are chunk (0, 0), (0, 1), ...,
    (A-1, B-1) with ``sizes[a, b]`` rows each; ``x[index]`` lists chunk (0, 0), (1, 0), ...
    (A-1, B-1). Used to turn tokens ordered (source rank, expert) into (expert, source
    rank) and back (``argsort`` of the index). Loop-free.
    """
    flat = sizes.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # start row of each chunk in [a, b] order
    sizes_t, starts_t = sizes.t().reshape(-1), starts.view(sizes.shape).t().reshape(-1)
    total = int(flat.sum())
    out_starts = torch.cumsum(sizes_t, 0) - sizes_t
    shift = torch.repeat_interleave(starts_t - out_starts, sizes_t, output_size=total)
    return torch.arange(total) + shift
