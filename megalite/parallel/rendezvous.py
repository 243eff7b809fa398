"""Rendezvous for a world of ranks that one parent process starts on this machine.

The test harness's rank pools and the benchmarks' spawned ranks both need a port to meet
on. Picking one by binding a socket to port 0, reading the number and closing the socket
races: between that close and rank 0's bind any other process (another pool, a parallel
test run) may take the port, and the world then fails to form. Here the parent itself
serves the ``TCPStore`` on port 0: the OS assigns the port in the same ``bind`` that keeps
it, and it stays bound for as long as the parent holds the :class:`LocalRendezvous`. The
ranks connect to it as clients.

    rendezvous = LocalRendezvous()             # parent: keep it until the ranks are done
    ... start ranks with rendezvous.port ...
    init_world(rank, world_size, port)         # in each rank: the default (world) group
    rendezvous.close()

Works for any backend that takes a store (gloo here, nccl too); nothing listens beyond
127.0.0.1.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

HOST = "127.0.0.1"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class LocalRendezvous:
    """A ``TCPStore`` server on ``127.0.0.1:<port the OS picked>``, held by the parent."""

    def __init__(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        self.store: dist.TCPStore | None = dist.TCPStore(
            HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.port: int = self.store.port

    def close(self) -> None:
        """Stop serving (dropping the last reference to the server closes its socket)."""
        self.store = None

    def __enter__(self) -> LocalRendezvous:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_world(rank: int, world_size: int, port: int, backend: str = "gloo",
               timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Join the world served by a :class:`LocalRendezvous` on ``port`` as ``rank``:
    ``torch.distributed``'s default process group is initialized on return."""
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
