"""Raw collectives of megalite.parallel.collectives on 1, 2 and 4 gloo ranks.

Each rank's input is a closed-form function of its global rank, so every result is checked
against what the group's members sent. Groups are both the world (``group=None``) and a
proper subgroup (``ps.tp`` of a tp=2 layout on 4 ranks).
"""

import pytest
import torch

from megalite.parallel import collectives as C
from tests.distributed.harness import parallel_state, run_distributed


def _x(rank, *shape, dtype=torch.float64):
    """Rank ``rank``'s input: distinct values per rank and element."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) + 100.0 * rank).to(dtype)


def _check_group(g, rank):
    """Every collective on group ``g`` (a Group of which ``rank`` is a member)."""
    n, members = g.size, g.ranks

    # all-reduce: SUM and MAX in place, returning the tensor
    t = _x(rank, 3, 2)
    assert C.all_reduce(t, g) is t
    assert torch.equal(t, sum(_x(r, 3, 2) for r in members))
    t = _x(rank, 4)
    C.all_reduce(t, g, C.ReduceOp.MAX)
    assert torch.equal(t, _x(max(members), 4))
    assert C.all_reduce_scalar(rank + 1.5, g) == sum(r + 1.5 for r in members)
    assert C.all_reduce_scalar(rank, g, C.ReduceOp.MAX) == max(members)

    # async all-reduce: a handle, or None on one rank
    t = _x(rank, 5)
    work = C.all_reduce_async(t, g)
    assert (work is None) == (n == 1)
    if work is not None:
        work.wait()
    assert torch.equal(t, sum(_x(r, 5) for r in members))

    # coalesced: mixed dtypes and shapes, summed in place
    a, b, c = _x(rank, 2, 3), _x(rank, 4, dtype=torch.float32), _x(rank, 1)
    C.all_reduce_coalesced([a, b, c], g)
    assert torch.equal(a, sum(_x(r, 2, 3) for r in members))
    assert torch.equal(b, sum(_x(r, 4, dtype=torch.float32) for r in members))
    assert b.dtype == torch.float32
    assert torch.equal(c, sum(_x(r, 1) for r in members))
    C.all_reduce_coalesced([], g)  # nothing to do

    # all-gather / reduce-scatter into preallocated tensors, sync and async
    mine = _x(rank, 3)
    full = torch.empty(3 * n, dtype=torch.float64)
    assert C.all_gather_into_tensor(full, mine, g) is None
    assert torch.equal(full, torch.cat([_x(r, 3) for r in members]))
    full.zero_()
    work = C.all_gather_into_tensor(full, mine, g, async_op=True)
    if work is not None:
        work.wait()
    assert torch.equal(full, torch.cat([_x(r, 3) for r in members]))
    partial = _x(rank, 2 * n)
    out = torch.empty(2, dtype=torch.float64)
    work = C.reduce_scatter_tensor(out, partial, g, async_op=True)
    if work is not None:
        work.wait()
    assert torch.equal(out, sum(_x(r, 2 * n) for r in members)[2 * g.rank:2 * g.rank + 2])

    # dim-0 gather / reduce-scatter returning new tensors ([m, ...] <-> [n * m, ...])
    gathered = C.all_gather_dim0(_x(rank, 2, 3), g)
    assert torch.equal(gathered, torch.cat([_x(r, 2, 3) for r in members]))
    summed = C.reduce_scatter_dim0(_x(rank, 2 * n, 3), g)
    assert torch.equal(summed, sum(_x(r, 2 * n, 3) for r in members)[2 * g.rank:2 * g.rank + 2])
    if n > 1:
        with pytest.raises(ValueError, match="not divisible"):
            C.reduce_scatter_dim0(_x(rank, 2 * n + 1), g)
    # non-contiguous input is made contiguous first
    gathered = C.all_gather_dim0(_x(rank, 3, 2).t(), g)
    assert torch.equal(gathered, torch.cat([_x(r, 3, 2).t() for r in members]))

    # list form
    pieces = C.all_gather_list(_x(rank, 2, 2), g)
    assert len(pieces) == n
    for r, p in zip(members, pieces):
        assert torch.equal(p, _x(r, 2, 2))

    # all-to-all, even: block j of rank i's input lands as block i on rank j
    blocks = torch.stack([torch.full((2,), 10.0 * rank + j) for j in range(n)])  # [n, 2]
    got = C.all_to_all(blocks, g)
    assert torch.equal(got, torch.stack([torch.full((2,), 10.0 * r + g.rank)
                                         for r in members]))
    # uneven: member i sends i + j + 1 rows to member j, each row tagged (i, j)
    send = [g.rank + j + 1 for j in range(n)]
    rows = torch.cat([torch.tensor([[g.rank, j]] * k, dtype=torch.float32)
                      for j, k in enumerate(send)])
    recv = [i + g.rank + 1 for i in range(n)]
    got = C.all_to_all(rows, g, send, recv)
    want = torch.cat([torch.tensor([[i, g.rank]] * k, dtype=torch.float32)
                      for i, k in enumerate(recv)])
    assert torch.equal(got, want)

    # python objects
    assert C.all_gather_object({"rank": rank}, g) == [{"rank": r} for r in members]


def _body(rank, world_size, tp):
    assert C.is_initialized() and C.world_size() == world_size
    with parallel_state(tensor_model_parallel_size=tp) as ps:
        assert ps.rank == rank
        _check_group(ps.tp, rank)
        _check_group(ps.dp, rank)
        # the world: group=None
        t = _x(rank, 3)
        C.all_reduce(t)
        assert torch.equal(t, sum(_x(r, 3) for r in range(world_size)))
        assert C.all_reduce_scalar(rank, None, C.ReduceOp.MAX) == world_size - 1
        assert C.all_gather_object(rank * 2) == [r * 2 for r in range(world_size)]
        objects = [f"from {rank}", rank]
        assert C.broadcast_object_list(objects, src=world_size - 1) is objects
        assert objects == [f"from {world_size - 1}", world_size - 1]
        side = C.new_world_group(backend="gloo")
        assert (side is None) == (world_size == 1)
        C.destroy_group(side)
    return True


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_collectives_on_gloo_ranks(world, tp):
    assert run_distributed(world, _body, tp) == [True] * world


def test_collectives_without_torch_distributed():
    """A single process that never initialized torch.distributed: every collective is the
    identity (or a copy into ``out``) and needs no process group."""
    from megalite.config import ParallelConfig
    from megalite.parallel.state import ParallelState

    if C.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    assert C.world_size() == 1
    ps = ParallelState.build(ParallelConfig())
    assert ps.tp.group is None
    _check_group(ps.tp, 0)
    x = _x(0, 2, 3)
    assert C.all_gather_dim0(x, ps.dp) is x
    assert C.reduce_scatter_dim0(x, ps.dp) is x
    assert C.all_to_all(x, ps.ep) is x
    assert C.all_reduce(x) is x and torch.equal(x, _x(0, 2, 3))
    assert C.all_gather_object("a") == ["a"]
    assert C.broadcast_object_list(["b"]) == ["b"]
    assert C.new_world_group() is None
