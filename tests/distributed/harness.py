"""Run a test body on N gloo ranks, reusing live rank pools across tests.

Starting a rank costs ~2 s of ``import torch``; a world of 8 on 2 cores costs 10+ s.
So each world size gets one :class:`RankPool` for the whole pytest session: N processes
forked from a forkserver that has already imported torch, each with an initialized gloo
world group and ``torch.set_num_threads(1)``, waiting for test bodies.

    from tests.distributed.harness import run_distributed

    def _body(rank, world_size, x):      # module level, so it pickles by reference
        ...
        return value

    def test_something():
        results = run_distributed(4, _body, 3)   # list of 4 return values, by rank

A rank that raises makes ``run_distributed`` raise :class:`DistributedTestError` with
every failing rank's traceback. A body that does not finish within ``timeout`` seconds
fails the test and the pool is killed (and rebuilt for the next test), so a hang in one
test never blocks the suite. After any failure the pool is rebuilt, since surviving ranks
may be stuck in a collective.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("MEGALITE_TEST_TIMEOUT", "240"))
_ERROR_GRACE_SECONDS = 5.0


class DistributedTestError(AssertionError):
    """One or more ranks raised, or the body timed out."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            torch.manual_seed(0)
            out = fn(rank, world_size, *args, **kwargs)
            results.put((task_id, rank, True, out))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` live gloo ranks that execute test bodies on request."""

    _ctx = None

    def __init__(self, world_size: int):
        if RankPool._ctx is None:
            RankPool._ctx = mp.get_context("forkserver")
            RankPool._ctx.set_forkserver_preload(["torch", "torch.distributed"])
        ctx = RankPool._ctx
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self._ids = itertools.count()
        self.broken = False

    def run(self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT,
            **kwargs: Any) -> list:
        task_id = next(self._ids)
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs))
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(outputs) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + _ERROR_GRACE_SECONDS)
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and not errors:
                self.broken = True
                raise DistributedTestError(f"rank(s) {dead} of world {self.world_size} died "
                                           f"(exit codes {[self.procs[r].exitcode for r in dead]})")
            if now >= deadline:
                self.broken = True
                missing = sorted(set(range(self.world_size)) - set(outputs) - set(errors))
                if errors:
                    break
                raise DistributedTestError(
                    f"{fn.__name__} timed out after {timeout:.0f}s on world {self.world_size}; "
                    f"ranks still running: {missing}")
            try:
                tid, rank, ok, value = self.results.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                continue
            if tid != task_id:  # a late answer from an earlier, failed task
                continue
            (outputs if ok else errors)[rank] = value
        if errors:
            self.broken = True
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise DistributedTestError(f"{fn.__name__} failed on rank(s) {sorted(errors)} of "
                                       f"world {self.world_size}:\n{text}")
        return [outputs[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, RankPool] = {}


def run_distributed(world_size: int, fn: Callable, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank of a pooled world.

    ``fn`` must be a module-level function. Returns the per-rank results in rank order.
    """
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        if pool.broken:
            pool.close()
            del _POOLS[world_size]


def close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)


@contextmanager
def parallel_state(**sizes: Any):
    """Build a :class:`ParallelState` from ParallelConfig fields and destroy it after.

    ``with parallel_state(tensor_model_parallel_size=2) as ps: ...``
    """
    from megalite.config import ParallelConfig
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(**sizes))
    try:
        yield ps
    finally:
        ps.destroy()
