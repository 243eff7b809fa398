"""Run a benchmark body on N fresh gloo ranks (spawned processes, one thread each).

    results = run_on_ranks(body, world, *args)   # body(rank, world, *args) -> picklable

Benchmarks use fresh processes rather than the test harness's pool: they are run one at a
time from the command line and must not share state with anything else.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, body, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=5))
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
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, body, args, queue))
             for r in range(world)]
    for proc in procs:
        proc.start()
    by_rank = dict(queue.get(timeout=timeout) for _ in range(world))
    for proc in procs:
        proc.join()
    return [by_rank[r] for r in range(world)]
