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


def _dirty_the_rank(rank, world_size, tmp):
    import random

    import numpy as np

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234 + rank)
    np.random.seed(1234)
    random.seed(1234)
    os.environ["MEGALITE_LEFT_BEHIND"] = "1"
    del os.environ["RANK"]
    os.chdir(tmp)
    dist.new_group([0, 1])  # left for the next body to find
    return os.getpid()


def _check_clean(rank, world_size, tmp):
    import random

    import numpy as np

    fresh = torch.Generator().manual_seed(0)
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == 1
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), fresh.get_state())
    assert np.random.random() == np.random.RandomState(0).random()
    assert random.random() == random.Random(0).random()
    assert "MEGALITE_LEFT_BEHIND" not in os.environ and os.environ["RANK"] == str(rank)
    assert os.getcwd() != tmp
    groups = list(dist.distributed_c10d._world.pg_map)
    assert groups == [dist.group.WORLD], groups
    return os.getpid()


def test_each_body_starts_from_a_clean_state(tmp_path):
    dirty = run_distributed(2, _dirty_the_rank, str(tmp_path))
    clean = run_distributed(2, _check_clean, str(tmp_path))
    assert dirty == clean  # the same processes: the pool was reused, not rebuilt
