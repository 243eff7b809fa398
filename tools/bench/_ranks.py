"""Run a benchmark body on N fresh gloo ranks (spawned processes, one thread each).

    results = run_on_ranks(body, world, *args)   # body(rank, world, *args) -> picklable

Benchmarks use fresh processes rather than the test harness's pool: they are run one at a
time from the command line and must not share state with anything else. The ranks meet on
a store this process serves on a port the OS picks (:mod:`megalite.parallel.rendezvous`,
shared with the test harness), so no other process can take the port in between. A rank
that raises, or dies, ends the run at once: the other ranks are stopped and
:class:`RankError` (with the rank's traceback) or :class:`RankDied` is raised.
"""

from __future__ import annotations

import datetime
import os
import queue as queues
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.parallel.rendezvous import LocalRendezvous, init_world

_TIMEOUT = datetime.timedelta(minutes=5)


class RankError(RuntimeError):
    """A rank raised (the message holds its traceback)."""


class RankDied(RankError):
    """A rank died without a result (killed, e.g. out of memory), or the ranks did not
    finish in time."""


def _worker(rank: int, world: int, port: int, body, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        init_world(rank, world, port, timeout=_TIMEOUT)
        try:
            queue.put((rank, True, body(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_on_ranks(body, world: int, *args, timeout: float = 600) -> list:
    """``body(rank, world, *args)`` on every rank of a new gloo world; results by rank.

    ``body`` must be a module-level function (it is pickled by reference).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with LocalRendezvous(timeout=_TIMEOUT) as rendezvous:
        procs = [ctx.Process(target=_worker,
                             args=(r, world, rendezvous.port, body, args, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        try:
            by_rank = _collect(queue, procs, time.monotonic() + timeout)
        except BaseException:
            for proc in procs:
                proc.terminate()
            raise
        finally:
            for proc in procs:
                proc.join()
    return [by_rank[r] for r in range(world)]


def _collect(queue, procs: list, deadline: float) -> dict:
    """Every rank's result, by rank; :class:`RankError` as soon as a rank raised,
    :class:`RankDied` as soon as one died without a result, or at ``deadline``."""
    by_rank = {}
    while len(by_rank) < len(procs):
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queues.Empty:
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                raise RankDied(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                                "before returning its result") from None
            if time.monotonic() > deadline:
                raise RankDied(f"{len(procs) - len(by_rank)} rank(s) did not finish in "
                                "time") from None
            continue
        if not ok:
            raise RankError(f"rank {rank} raised:\n{value}")
        by_rank[rank] = value
    return by_rank
