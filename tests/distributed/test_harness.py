"""The multi-rank harness itself: results, errors with tracebacks, timeouts, reuse."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import DistributedTestError, run_distributed


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads(), os.getpid()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _hang(rank, world_size):
    if rank == 0:
        time.sleep(30)
    return rank


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_collective_and_threads(world):
    out = run_distributed(world, _allreduce_rank)
    assert [o[0] for o in out] == [world * (world - 1) / 2] * world
    assert all(o[1] == 1 for o in out)


def test_pool_is_reused():
    first = {o[2] for o in run_distributed(2, _allreduce_rank)}
    second = {o[2] for o in run_distributed(2, _allreduce_rank)}
    assert first == second


def test_rank_error_reports_rank_and_traceback():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, _fail_on_rank_one)
    msg = str(info.value)
    assert "rank(s) [1]" in msg and "boom on purpose" in msg and "ValueError" in msg
    # the pool is rebuilt and works again
    assert [o[0] for o in run_distributed(2, _allreduce_rank)] == [1.0, 1.0]


def test_timeout_fails_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(2, _hang, timeout=3)
    assert time.monotonic() - start < 20
    assert [o[0] for o in run_distributed(2, _allreduce_rank)] == [1.0, 1.0]
