"""torchrun as the launch scripts run it: ``python -m megalite.launch ARGS`` is ``torchrun
ARGS``, except when a signal stops the launcher itself.

Ctrl-C sends SIGINT to every process of the job, the launcher included, and a scheduler may
send SIGTERM to all of them at once. torchrun then passes the signal on to its workers,
waits for them (a worker with ``--exit-signal-handler`` saves a checkpoint and exits 0
first) and raises, printing a traceback. Here that ends in one line and the status
``128 + signal``; the launch scripts (``scripts/_forward_sigterm.sh``) then exit with the
workers' own exit codes. Any other failure is torchrun's, unchanged.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        print(f"megalite: the launcher stopped on {e.sigval.name} once its workers had "
              "stopped", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
