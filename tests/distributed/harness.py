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

Each body starts from the same state, whatever the previous body on that rank did:
seeds 0 (torch, numpy, random), default dtype float32, one thread, grad mode on,
deterministic-algorithm flags, environment variables and working directory as after
start-up, and no process group but the world (leftover groups are destroyed). The ranks
meet on a store the pytest process serves on a port the OS picked
(:mod:`megalite.parallel.rendezvous`), so two pools never race for one port.

A rank that raises makes ``run_distributed`` raise :class:`DistributedTestError` with
every failing rank's traceback. A body that does not finish within ``timeout`` seconds
fails the test and the pool is killed (and rebuilt for the next test), so a hang in one
test never blocks the suite. After any failure the pool is rebuilt, since surviving ranks
may be stuck in a collective.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import queue
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

from megalite.parallel.rendezvous import LocalRendezvous, init_world

DEFAULT_TIMEOUT = float(os.environ.get("MEGALITE_TEST_TIMEOUT", "240"))
_ERROR_GRACE_SECONDS = 5.0


class DistributedTestError(AssertionError):
    """One or more ranks raised, or the body timed out."""


class _CleanState:
    """The per-process state a test body may change, as captured once after start-up, and
    put back before every body (see the module docstring)."""

    def __init__(self) -> None:
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)

    def restore(self) -> None:
        import random

        import numpy as np
        import torch
        import torch.distributed as dist

        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(self.device)
        enabled, warn_only = self.deterministic
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self.cudnn
        torch.set_num_threads(1)
        torch.set_grad_enabled(True)
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        world = dist.group.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not world:
                dist.destroy_process_group(group)


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_world(rank, world_size, port, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))
    clean = _CleanState()
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            clean.restore()
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
        # served here for the pool's lifetime: the port stays bound, nobody can take it
        self.rendezvous = LocalRendezvous(datetime.timedelta(seconds=DEFAULT_TIMEOUT))
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world_size, self.rendezvous.port, self.tasks[r],
                                        self.results))
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
        self.rendezvous.close()


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
