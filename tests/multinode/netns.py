"""Emulated hosts for multi-node tests: Linux network namespaces joined by a bridge.

Each host is a network namespace with one veth interface (``eth0``, a private address in
``10.213.<net>.0/24``) whose other end sits on a bridge that only this cluster's veths join
(the bridge has no address: traffic stays among the namespaces). A command runs on a host
under ``ip netns exec`` (which bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``)
and ``unshare --uts`` (its own host name). The filesystem is shared, as a cluster's
checkpoint directory would be; so is the process table (a host's /proc is not used by
megalite to judge another host's ranks: it compares host names).

Names carry a prefix and the creating process's pid (``mln<pid>h0``, ``mlv<pid>h0``,
``mlb<pid>``): :func:`remove_leftovers` deletes those of processes that no longer run, so a
crashed run does not break the next one, and :class:`Cluster` tears its own down in
``close`` (a context manager: also on failure). Needs root and a working ``ip netns``:
:func:`unavailable` says why not.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import time

PREFIX_NS, PREFIX_VETH, PREFIX_BRIDGE = "mln", "mlv", "mlb"
_OWNED = re.compile(rf"^(?:{PREFIX_NS}|{PREFIX_VETH}|{PREFIX_BRIDGE})(\d+)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare`"
    name = f"{PREFIX_NS}{os.getpid()}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_leftovers() -> list[str]:
    """Delete namespaces, links and /etc/netns folders of this harness whose creating
    process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _OWNED.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        m = _OWNED.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    if os.path.isdir("/etc/netns"):
        for ns in os.listdir("/etc/netns"):
            m = _OWNED.match(ns)
            if m and not _alive(int(m.group(1))):
                shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    return removed


class Host:
    """One emulated host: ``name`` (its host name), ``ns``, ``address``."""

    def __init__(self, cluster: Cluster, index: int, name: str):
        self.cluster, self.index, self.name = cluster, index, name
        self.ns = f"{PREFIX_NS}{os.getpid()}h{index}"
        self.veth = f"{PREFIX_VETH}{os.getpid()}h{index}"
        self.address = f"10.213.{cluster.net}.{index + 1}"
        self.procs: list[subprocess.Popen] = []

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host (its namespace, its host name)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *argv]

    def start(self, argv: list[str], log: str, env: dict | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        """Start ``argv`` here in the background, output to the file ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.command(argv), stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def kill(self) -> None:
        """Lose the host: SIGKILL every process in its namespace (its torchrun, workers)."""
        _kill_namespace_processes(self.ns)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def write_hosts(self, loopback_own_name: bool = False) -> None:
        """This host's /etc/hosts: every host's name and address; with
        ``loopback_own_name`` its own name maps to 127.0.1.1 (Debian's default)."""
        lines = ["127.0.0.1 localhost"]
        for h in self.cluster.hosts:
            if h is self and loopback_own_name:
                lines.append(f"127.0.1.1 {h.name}")
            else:
                lines.append(f"{h.address} {h.name}")
        folder = f"/etc/netns/{self.ns}"
        os.makedirs(folder, exist_ok=True)
        with open(f"{folder}/hosts", "w") as f:
            f.write("\n".join(lines) + "\n")


class Cluster:
    """``names``: the hosts' names; ``with Cluster([...]) as c:`` builds and tears down."""

    def __init__(self, names: list[str]):
        self.net = random.randint(1, 250)
        self.bridge = f"{PREFIX_BRIDGE}{os.getpid()}"
        self.hosts = [Host(self, i, n) for i, n in enumerate(names)]

    def __enter__(self) -> Cluster:
        remove_leftovers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.veth + "p")
            _ip("link", "set", h.veth + "p", "netns", h.ns)
            _ip("link", "set", h.veth, "master", self.bridge, "up")
            inside = ["netns", "exec", h.ns, "ip"]
            _ip(*inside, "link", "set", h.veth + "p", "name", "eth0")
            _ip(*inside, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
        for h in self.hosts:
            h.write_hosts()

    def close(self) -> None:
        """Stop every process on the hosts, then delete namespaces, links, /etc/netns."""
        for h in self.hosts:
            for proc in h.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            _kill_namespace_processes(h.ns)
        time.sleep(0.2)
        for h in self.hosts:
            _ip("netns", "del", h.ns, check=False)
            _ip("link", "del", h.veth, check=False)
            shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
