"""The emulated-host harness cleans up: leftovers of a crashed run (named for a process
that no longer runs) are removed before a cluster is built, and a cluster leaves nothing
behind, also when a test fails inside it."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.multinode import netns

WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _ours() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in names.splitlines() if line.strip()]
    found += [line.split(": ")[1].split("@")[0] for line in links.splitlines()]
    return [n for n in found if n.startswith((netns.PREFIX_NS, netns.PREFIX_VETH,
                                              netns.PREFIX_BRIDGE))]


def test_leftovers_of_a_dead_run_go_and_a_failing_cluster_leaves_nothing():
    pid = _dead_pid()
    crashed = [f"{netns.PREFIX_NS}{pid}h0", f"{netns.PREFIX_BRIDGE}{pid}"]
    subprocess.run(["ip", "netns", "add", crashed[0]], check=True)
    subprocess.run(["ip", "link", "add", crashed[1], "type", "bridge"], check=True)
    os.makedirs(f"/etc/netns/{crashed[0]}", exist_ok=True)
    with pytest.raises(RuntimeError, match="a test failing"):
        with netns.Cluster(["node0", "node1"]) as cluster:
            assert not set(crashed) & set(_ours())
            assert not os.path.exists(f"/etc/netns/{crashed[0]}")
            assert {h.ns for h in cluster.hosts} <= set(_ours())
            raise RuntimeError("a test failing inside the cluster")
    assert not [n for n in _ours() if str(os.getpid()) in n]
    left = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    assert not any(str(os.getpid()) in d for d in left)
