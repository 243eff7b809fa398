"""Rendezvous: the store a world of ranks meets on.

Two cases: a world of ranks that one parent process starts on this machine (the test
harness, the benchmarks: :class:`LocalRendezvous`), and a torchrun attempt, whose ranks
need a store that no earlier attempt of the same job wrote to (:func:`attempt_store`).

Local worlds.

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
import os
import socket
import time
import uuid

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


# -- torchrun restarts: a store of this attempt only ---------------------------------------
ELASTIC_ADDRESS_KEY = "megalite/attempt-store"
_NONCE_KEY = "megalite/attempt-nonce"
_attempt_server: dist.TCPStore | None = None   # rank 0 serves its attempt's store while alive


def uses_agent_store() -> bool:
    """True under torchrun, whose agent serves the store every attempt's workers share."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the interface that routes to ``host`` (what the other
    ranks can reach), found without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def attempt_store(rank: int, timeout: datetime.timedelta) -> dist.Store:
    """A fresh ``TCPStore`` for this torchrun attempt, served by global rank 0.

    torchrun's agent keeps one store for all restarts of a job (it shares its rendezvous
    ``TCPStore`` with the workers), and ``init_process_group`` writes each attempt's keys
    (gloo's listening addresses, NCCL's unique id) under the same names. A restarted
    worker can read the previous attempt's entry before the new rank 0 overwrote it, then
    connects to a dead address ("Connection refused") or waits forever (PyTorch's GitHub
    issue pytorch/pytorch#135712; ``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts
    apart, as every agent counts its own restarts). Here rank 0 serves a new store on a
    port the OS assigns and publishes ``host:port:nonce`` in the agent's store; the other
    ranks connect to the address they read and accept it only when the store answers
    with the same nonce, so an address left by an earlier attempt (its server died with
    its rank 0) is skipped until the new one appears.
    """
    global _attempt_server
    master = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(*master, is_master=False, timeout=timeout)
    if rank == 0:
        host = _address_towards(*master)
        _attempt_server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timeout)
        nonce = uuid.uuid4().hex
        _attempt_server.set(_NONCE_KEY, nonce)
        agent.set(ELASTIC_ADDRESS_KEY, f"{host}:{_attempt_server.port}:{nonce}")
        return _attempt_server
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port, nonce = agent.get(ELASTIC_ADDRESS_KEY).decode().rsplit(":", 2)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()  # a live server?
            client = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=datetime.timedelta(seconds=2))
            if client.get(_NONCE_KEY).decode() == nonce:
                client.set_timeout(timeout)
                return client
        except (OSError, RuntimeError, ValueError):   # refused, or not this attempt's store
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no store of this torchrun attempt appeared at "
                               f"{master[0]}:{master[1]} within {timeout}; is global rank 0 "
                               f"running?")
        time.sleep(0.2)
