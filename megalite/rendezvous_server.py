"""A rendezvous for torchrun's c10d backend on a host outside the job.

By default the rendezvous store lives in the torchrun of the node named by the endpoint
(``MASTER_ADDR``): when that node is lost, every other node loses the store and its job
ends. Served here, on a host that stays up (a login or head node), any node of the job
may die and be replaced:

    python -m megalite.rendezvous_server --port 29400
    RDZV_ENDPOINT=thishost:29400 ... bash scripts/pretrain_multi_node.sh   # on every node

It serves a ``TCPStore`` on all interfaces until SIGTERM / Ctrl-C; jobs sharing it need
distinct ``--rdzv_id`` (``RDZV_ID``).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import threading


def serve(port: int, ready=None, stop: threading.Event | None = None) -> None:
    """Serve the store on ``port`` (0: any; ``ready(port)`` is called with the port taken)
    until ``stop`` is set."""
    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(hours=1), multi_tenant=True)
    if ready is not None:
        ready(store.port)
    (stop or threading.Event()).wait()
    del store


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=29400)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.port, lambda port: print(f"megalite: rendezvous store on port {port}",
                                        flush=True), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
