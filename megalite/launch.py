"""torchrun as the launch scripts run it: ``python -m megalite.launch ARGS`` is ``torchrun
ARGS``, with three differences.

Ctrl-C sends SIGINT to every process of the job, the launcher included, and a scheduler may
send SIGTERM to all of them at once. torchrun then passes the signal on to its workers,
waits for them (a worker with ``--exit-signal-handler`` saves a checkpoint and exits 0
first) and raises, printing a traceback. Here that ends in one line and the status
``128 + signal``; the launch scripts (``scripts/_forward_sigterm.sh``) then exit with the
workers' own exit codes. Any other failure is torchrun's, unchanged.

Restarts across hosts work: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless set. With
torchrun's default (the workers share the agent's rendezvous store), a node that replaces
a lost one never joins: the surviving agent keeps its store from the earlier round and
never publishes ``MASTER_ADDR`` for the new one, and both wait 60 s and die
(``DistStoreError ... keys: /torch.rendezvous.<id>.1/MASTER_ADDR``). Unshared, rank 0's
agent publishes a fresh address every round and the workers meet on a store of their own.

A host whose name resolves to loopback (Debian's and Ubuntu's ``127.0.1.1``) in a job
across hosts would advertise an address no other host can reach
(:mod:`megalite.parallel.network`). Before torchrun starts, the launcher finds the
interface that routes to the rendezvous endpoint and sets ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` to it and torchrun's ``--local-addr`` to its address (each only
when not set), saying so in one line; ``MEGALITE_PICK_INTERFACE=0`` makes it stop with
the two settings to make instead (exit 2), as it does when no such interface exists.
"""

from __future__ import annotations

import os
import sys

from megalite.errors import EXIT_CONFIG

SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_SWITCHES = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path",
             "--run_path", "--virtual-local-rank", "--virtual_local_rank"}  # take no value


def launcher_args(argv: list[str]) -> list[str]:
    """torchrun's own arguments: those before the training script."""
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            continue
        before = argv[i - 1] if i else ""
        if not before.startswith("-") or before in _SWITCHES or "=" in before:
            return argv[:i]
    return argv


def _option(argv: list[str], *names: str) -> str | None:
    """The value of torchrun option ``names`` (``--a b`` or ``--a=b``; the ``-``/``_``
    spellings) among the launcher's own arguments (before the script), else its ``PET_``
    variable."""
    spellings = {n for name in names for n in (name, name.replace("_", "-"),
                                               name.replace("-", "_"))}
    argv = launcher_args(argv)
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in spellings:
            return value if value or "=" in arg else (argv[i + 1] if i + 1 < len(argv)
                                                      else None)
    for name in names:
        var = "PET_" + name.lstrip("-").replace("-", "_").upper()
        if var in os.environ:
            return os.environ[var]
    return None


def endpoint_host(argv: list[str]) -> str | None:
    """The rendezvous host of a job that may span hosts, or None (one node, standalone)."""
    if "--standalone" in launcher_args(argv) or os.environ.get("PET_STANDALONE"):
        return None
    nnodes = _option(argv, "--nnodes") or "1"
    if nnodes.split(":")[-1] == "1":
        return None
    endpoint = _option(argv, "--rdzv_endpoint") or _option(argv, "--master_addr")
    if not endpoint:
        return None
    if endpoint.startswith("["):
        return endpoint[1:].split("]")[0]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint


def prepare_network(argv: list[str], log=print) -> list[str]:
    """torchrun's arguments with ``--local-addr`` added and the interface variables set
    when this host would advertise loopback (see the module's docstring); raises
    SystemExit(2) with the fix when it cannot or may not pick the interface."""
    from megalite.parallel import network

    host = endpoint_host(argv)
    if host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return argv
    problem = network.loopback_problem(host)
    if problem is None:
        return argv
    address = network.route_to(host)
    name = network.interface_of(address) if address else None
    if os.environ.get("MEGALITE_PICK_INTERFACE", "1") == "0" or name is None \
            or network.is_loopback(address or "127.0.0.1"):
        log(f"megalite: error: {problem}; {network.fix_hint(host)}")
        raise SystemExit(EXIT_CONFIG)
    picked = []
    for var in network.IFNAME_VARS:
        if not os.environ.get(var):
            os.environ[var] = name
            picked.append(f"{var}={name}")
    if _option(argv, "--local_addr") is None:
        argv = ["--local-addr", address, *argv]
        picked.append(f"--local-addr {address}")
    log(f"megalite: {problem}; using interface {name} ({address}), the one that routes to "
        f"{host}: {', '.join(picked)} (set them yourself to choose another; "
        "MEGALITE_PICK_INTERFACE=0 stops instead)")
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault(SHARE_STORE_VAR, "1")
    argv = prepare_network(argv, log=lambda s: print(s, file=sys.stderr, flush=True))

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
