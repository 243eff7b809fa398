"""Run a benchmark body on N fresh gloo ranks (spawned processes, one thread each).

    results = run_on_ranks(body, world, *args)   # body(rank, world, *args) -> picklable

Benchmarks use fresh processes rather than the test harness's pool: they are run one at a
time from the command line and must not share state with anything else. The ranks meet on
a store this process serves on a port the OS picks (:mod:`megalite.parallel.rendezvous`,
shared with the test harness), so no other process can take the port in between.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megalite.parallel.rendezvous import LocalRendezvous, init_world

_TIMEOUT = datetime.timedelta(minutes=5)


def _worker(rank: int, world: int, port: int, body, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    init_world(rank, world, port, timeout=_TIMEOUT)
    try:
        queue.put((rank, body(rank, world, *args)))
    finally:
        dist.destroy_process_group()


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
        by_rank = dict(queue.get(timeout=timeout) for _ in range(world))
        for proc in procs:
            proc.join()
    return [by_rank[r] for r in range(world)]
