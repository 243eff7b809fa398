"""Raw collectives (no autograd): the one place megalite calls ``torch.distributed``'s
collective operations.

Every function takes its process group as a :class:`megalite.parallel.state.Group` (for
example ``ps.tp``, ``ps.dp_cp``, ``ps.edp``, ``ps.pp``); where ``group`` may be None the
collective runs on the default (world) group. All of them short-circuit when only one rank
takes part (``group.size == 1``, or a world that never initialized torch.distributed), so
single-process code never touches ``torch.distributed`` and callers need no
``if size > 1`` of their own. Ranks outside a group (``member=False``) have size 1 and
take the same shortcut.

Autograd-aware wrappers live beside their users and call these bodies:
:mod:`megalite.parallel.mappings` (tensor/sequence parallel regions) and
:mod:`megalite.moe.comm` (token dispatch). Pipeline stage-to-stage transfers are point to
point and stay in :mod:`megalite.pipeline.p2p`.

Shapes below: ``n = group.size``; "dim 0" collectives concatenate or split along the first
dimension in rank order.

Every collective that leaves the rank is recorded in :mod:`megalite.parallel.watchdog`'s
flight recorder (a sequence number per group and a ring-buffer entry; the heartbeat thread
publishes progress), and a communication failure (a timeout after
``--distributed-timeout-minutes``, a peer that closed its connection) is raised as one
:class:`~megalite.parallel.watchdog.DistributedFaultError` naming the group, the operation
and the ranks that never arrived. Asynchronous launches return a :class:`TrackedWork`
whose ``wait()`` does the same.

Under ``torch.compile`` (``--compile`` traces each transformer layer) :func:`all_reduce`,
:func:`all_gather_dim0`, :func:`reduce_scatter_dim0`, :func:`all_to_all` and the two
``*_into_tensor`` / ``*_tensor`` forms (which then complete at once, returning no work
handle, and leave the overlap to the compiler) run as torch's functional collectives
(``torch.distributed._functional_collectives``), which the compiler traces into the layer's
graph instead of breaking it at every collective; the flight recorder, whose clock and ring
buffer a graph cannot hold, does not see them (a hang there still ends at
``--distributed-timeout-minutes``, with torch's error rather than the recorder's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalite.parallel.state import Group
from megalite.parallel.watchdog import RECORDER

ReduceOp = dist.ReduceOp
# the functional collectives name their reductions
_FUNCTIONAL_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                   ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "product"}

# Newer torch names the single-tensor collectives all_gather_single / reduce_scatter_single;
# older releases only have all_gather_into_tensor / reduce_scatter_tensor. Resolved once here.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


# -- the world ---------------------------------------------------------------------------
def is_initialized() -> bool:
    """Whether torch.distributed is available and its default group initialized."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Ranks in the default group; 1 when torch.distributed is not initialized."""
    return dist.get_world_size() if is_initialized() else 1


def _alone(group: Group | None) -> bool:
    """True when the collective involves only this rank."""
    return world_size() == 1 if group is None else group.size == 1


def _pg(group: Group | None):
    return None if group is None else group.group


def _traced() -> bool:
    """Whether torch.compile is tracing this call (its collectives go functional)."""
    return torch.compiler.is_compiling()


def _functional():
    from torch.distributed import _functional_collectives as funcol
    return funcol


def _begin(group: Group | None, op: str, /, *args):
    """Flight-recorder entry of ``op`` on ``group`` (None: the world); the shapes of the
    tensors among ``args`` go with it."""
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)] or None
    if group is None:
        return RECORDER.begin("world", list(range(world_size())), op, shapes)
    return RECORDER.begin(group.name, group.ranks, op, shapes)


def _run(entry, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a blocking collective or a launch) under ``entry``: a
    communication failure becomes the flight recorder's one-line error."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise RECORDER.fault(entry, exc) from exc


class TrackedWork:
    """A ``torch.distributed`` work handle whose ``wait()`` completes its flight-recorder
    entry, or raises the one-line error when the collective fails."""

    __slots__ = ("work", "entry")

    def __init__(self, work, entry):
        self.work, self.entry = work, entry

    def wait(self) -> bool:
        since = time.time()
        _run(self.entry, self.work.wait)
        RECORDER.end(self.entry, since)
        return True

    def is_completed(self) -> bool:
        if self.work.is_completed():
            if self.entry["end"] is None:
                RECORDER.end(self.entry, time.time())
            return True
        return False


def _sync(group: Group | None, name: str, fn, /, *args, **kwargs) -> None:
    """Run the blocking collective ``fn(*args, **kwargs)`` (called ``name`` in the flight
    recorder) on ``group`` and record it."""
    entry = _begin(group, name, *args)
    _run(entry, fn, *args, **kwargs)
    RECORDER.end(entry)


def _launch(group: Group, name: str, fn, /, *args, **kwargs) -> TrackedWork:
    """Launch ``fn(*args, async_op=True, **kwargs)`` on ``group``; its tracked work."""
    entry = _begin(group, name, *args)
    return TrackedWork(_run(entry, fn, *args, async_op=True, **kwargs), entry)


def new_world_group(backend: str = "gloo"):
    """A second process group over the whole world (``torch.distributed.new_group``), e.g.
    a gloo group that a background thread's collectives use so that they never interleave
    with training's. Collective: every rank must call it, in the same order. None when the
    world is one process."""
    if world_size() == 1:
        return None
    return dist.new_group(backend=backend)


def destroy_group(pg) -> None:
    """Destroy a group made by :func:`new_world_group` (a no-op for None)."""
    if pg is not None:
        dist.destroy_process_group(pg)


# -- all-reduce --------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, group: Group | None = None,
               op=ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``tensor`` (any shape, contiguous) in place over ``group`` (None: the world)
    with ``op`` (SUM, MAX, ...); returns ``tensor``."""
    if _alone(group):
        return tensor
    if _traced():
        pg = _pg(group) or dist.group.WORLD
        return tensor.copy_(_functional().all_reduce(tensor, _FUNCTIONAL_OPS[op], pg))
    _sync(group, "all_reduce", dist.all_reduce, tensor, op=op, group=_pg(group))
    return tensor


def all_reduce_async(tensor: torch.Tensor, group: Group):
    """Launch a SUM of ``tensor`` in place over ``group`` without waiting; returns the
    work handle (a :class:`TrackedWork`: ``.wait()`` completes it), or None with one
    member."""
    if group.size == 1:
        return None
    return _launch(group, "all_reduce", dist.all_reduce, tensor, group=group.group)


def all_reduce_scalar(value: float, group: Group | None = None, op=ReduceOp.SUM,
                      device: torch.device | None = None) -> float:
    """``value`` reduced with ``op`` over ``group`` (None: the world), as a python float
    (one fp64 element on the wire). ``device`` must be the rank's device under NCCL."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce(t, group, op).item())


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """SUM ``tensors`` (any shapes) over ``group`` in place, one flat all-reduce per dtype
    (in order of first appearance)."""
    if group.size == 1 or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        _sync(group, "all_reduce", dist.all_reduce, flat, group=group.group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


# -- all-gather / reduce-scatter ---------------------------------------------------------
def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group: Group,
                           async_op: bool = False):
    """All-gather over ``group`` into a preallocated ``out``: ``x`` ``[m, ...]`` on every
    rank -> ``out`` ``[n * m, ...]``, rank r's ``x`` at rows ``[r * m, (r + 1) * m)``
    (1-D: elements). ``out`` and ``x`` must be contiguous and must not alias. Returns the
    work handle with ``async_op`` (else None); with one member copies ``x`` into ``out``."""
    if group.size == 1:
        out.copy_(x.reshape(out.shape))
        return None
    if _traced():
        out.copy_(_functional().all_gather_tensor(x, 0, group.group).view(out.shape))
        return None
    if async_op:
        return _launch(group, "all_gather", _all_gather_single, out, x, group=group.group)
    _sync(group, "all_gather", _all_gather_single, out, x, group=group.group)
    return None


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, group: Group,
                          async_op: bool = False):
    """Reduce-scatter (SUM) over ``group`` into a preallocated ``out``: ``x`` ``[n * m, ...]``
    partial sums on every rank -> ``out`` ``[m, ...]``, this rank's block
    ``[rank * m, (rank + 1) * m)`` of their sum. Contiguous, not aliasing. Returns the
    work handle with ``async_op`` (else None); with one member copies ``x`` into ``out``."""
    if group.size == 1:
        out.copy_(x.reshape(out.shape))
        return None
    if _traced():
        out.copy_(_functional().reduce_scatter_tensor(x, "sum", 0, group.group).view(out.shape))
        return None
    if async_op:
        return _launch(group, "reduce_scatter", _reduce_scatter_single, out, x,
                       group=group.group)
    _sync(group, "reduce_scatter", _reduce_scatter_single, out, x, group=group.group)
    return None


def all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` ``[m, ...]`` on every rank -> ``[n * m, ...]`` in rank order (a new tensor;
    ``x`` itself with one member)."""
    if group.size == 1:
        return x
    x = x.contiguous()
    if _traced():
        return _functional().all_gather_tensor(x, 0, group.group)
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    _sync(group, "all_gather", _all_gather_single, out, x, group=group.group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` ``[n * m, ...]`` partial sums on every rank -> this rank's ``[m, ...]`` block
    of their SUM (``x`` itself with one member). Dim 0 must divide by ``n``."""
    if group.size == 1:
        return x
    size = x.shape[0]
    if size % group.size:
        raise ValueError(f"dim 0 ({size}) is not divisible by the group size {group.size}")
    x = x.contiguous()
    if _traced():
        return _functional().reduce_scatter_tensor(x, "sum", 0, group.group)
    out = x.new_empty((size // group.size, *x.shape[1:]))
    _sync(group, "reduce_scatter", _reduce_scatter_single, out, x, group=group.group)
    return out


def all_gather_list(x: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """``x`` (any shape) on every rank -> ``n`` tensors of that shape, rank r's at index r
    (``[x]`` with one member)."""
    if group.size == 1:
        return [x]
    pieces = [torch.empty_like(x) for _ in range(group.size)]
    _sync(group, "all_gather", dist.all_gather, pieces, x.contiguous(), group=group.group)
    return pieces


# -- all-to-all --------------------------------------------------------------------------
def all_to_all(x: torch.Tensor, group: Group, send: Sequence[int] | None = None,
               recv: Sequence[int] | None = None) -> torch.Tensor:
    """All-to-all of rows over ``group`` (``all_to_all_single``).

    Even (``send``/``recv`` None): ``x`` ``[n * m, ...]``, block r goes to rank r; returns
    ``[n * m, ...]`` whose block r came from rank r. Uneven: ``x`` ``[sum(send), ...]``,
    its first ``send[0]`` rows go to rank 0, the next ``send[1]`` to rank 1, ...; returns
    ``[sum(recv), ...]`` with ``recv[r]`` rows from rank r, in rank order (both sides must
    know the sizes). ``x`` itself with one member.
    """
    if group.size == 1:
        return x
    if _traced():
        return _functional().all_to_all_single(
            x.contiguous(), None if recv is None else list(recv),
            None if send is None else list(send), group.group)
    if send is None:
        out = torch.empty_like(x)
        _sync(group, "all_to_all", dist.all_to_all_single, out, x.contiguous(),
              group=group.group)
        return out
    out = x.new_empty((sum(recv), *x.shape[1:]))
    _sync(group, "all_to_all", dist.all_to_all_single, out, x.contiguous(),
          output_split_sizes=list(recv), input_split_sizes=list(send), group=group.group)
    return out


def all_to_all_async(x: torch.Tensor, group: Group, send: Sequence[int],
                     recv: Sequence[int]) -> tuple[torch.Tensor, TrackedWork]:
    """The uneven :func:`all_to_all` launched with ``async_op=True``: returns the output
    ``[sum(recv), ...]`` (valid once the work is waited on) and its tracked work. Needs
    ``group.size > 1``."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = _launch(group, "all_to_all", dist.all_to_all_single, out, x.contiguous(),
                   output_split_sizes=list(recv), input_split_sizes=list(send),
                   group=group.group)
    return out, work


# -- ring (context parallel) ------------------------------------------------------------
def ring_exchange(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, list]:
    """Start passing ``x`` (any shape) one step around the ring of ``group`` (``ps.cp`` for
    ring attention): send it to the next rank (``rank + 1 mod n``), receive a tensor of the
    same shape from the previous one. Returns ``(received, works)``; ``received`` is
    valid after :func:`wait_all` (``works``). With one member ``x`` itself comes back."""
    if group.size == 1:
        return x, []
    n, r = group.size, group.rank
    x = x.contiguous()
    out = torch.empty_like(x)
    nxt, prev = group.ranks[(r + 1) % n], group.ranks[(r - 1) % n]
    works = batch_isend_irecv([(x, nxt)], [(out, prev)], group)
    return out, works


def batch_isend_irecv(sends: list[tuple[torch.Tensor, int]],
                      recvs: list[tuple[torch.Tensor, int]], group: Group) -> list:
    """Post point-to-point ``sends`` then ``recvs`` (``(tensor, global peer rank)`` pairs,
    no tags) as one ``batch_isend_irecv`` on ``group`` (``ps.pp`` for pipeline stages,
    ``ps.cp`` for the ring); returns one :class:`TrackedWork` per op (or one for the
    whole batch, as NCCL gives), each completing the batch's flight-recorder entry."""
    ops = ([dist.P2POp(dist.isend, t, peer, group.group) for t, peer in sends]
           + [dist.P2POp(dist.irecv, t, peer, group.group) for t, peer in recvs])
    op = ("p2p" + "".join(f" send->{p}" for _, p in sends)
          + "".join(f" recv<-{p}" for _, p in recvs))
    entry = RECORDER.begin(group.name, group.ranks, op,
                           [tuple(t.shape) for t, _ in sends + recvs], key="p2p")
    entry["peers"] = sorted({p for _, p in sends + recvs})
    works = _run(entry, dist.batch_isend_irecv, ops)
    return [TrackedWork(w, entry) for w in works]


def wait_all(works: list) -> None:
    """Complete the work handles of :func:`ring_exchange`."""
    for work in works:
        work.wait()


# -- python objects ----------------------------------------------------------------------
def all_gather_object(obj, group: Group | None = None) -> list:
    """Every rank's picklable ``obj`` over ``group`` (None: the world), in rank order
    (``[obj]`` with one member)."""
    if _alone(group):
        return [obj]
    out = [None] * (world_size() if group is None else group.size)
    _sync(group, "all_gather_object", dist.all_gather_object, out, obj, group=_pg(group))
    return out


def broadcast_object_list(objects: list, src: int = 0, group: Group | None = None) -> list:
    """Replace ``objects`` in place by global rank ``src``'s list (picklable items) over
    ``group`` (None: the world); returns ``objects``."""
    if not _alone(group):
        _sync(group, "broadcast_object_list", dist.broadcast_object_list, objects, src=src,
              group=_pg(group))
    return objects
