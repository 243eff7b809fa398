"""The launcher before torchrun starts: restarts across hosts on by default, and a host
whose name resolves to loopback caught (and fixed) before any process group exists."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megalite import launch
from megalite.parallel import network

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBIAN = {"node1": ["127.0.1.1"], "node0": ["10.77.0.1"], "localhost": ["127.0.0.1"]}


@pytest.fixture(autouse=True)
def _environment_restored():
    """The launcher sets ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` and the rendezvous
    variable in this process's environment; monkeypatch does not undo a variable it
    deleted while absent, and a stale interface name breaks every later test that starts
    ranks. Restore the whole environment after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_loopback_host_name_is_told_from_the_resolvers_answers():
    said = network.loopback_problem("node0", "node1", resolver=lambda h: DEBIAN.get(h, []))
    assert said == ("this host's name 'node1' resolves to 127.0.1.1 (loopback) while the "
                    "rendezvous endpoint node0 is at 10.77.0.1: the ranks here would "
                    "advertise a loopback address that the other hosts cannot reach, and "
                    "the job would hang for the whole timeout")
    fixed = dict(DEBIAN, node1=["10.77.0.2"])
    assert network.loopback_problem("node0", "node1", resolver=fixed.get) is None
    # one host: the endpoint is loopback too, nothing to advertise elsewhere
    assert network.loopback_problem("localhost", "node1", resolver=DEBIAN.get) is None


def test_a_worker_across_hosts_stops_with_the_two_settings(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    said = network.worker_check("node1", resolver=DEBIAN.get)
    assert said.startswith("this host's name 'node1' resolves to 127.0.1.1 (loopback)")
    assert "set GLOO_SOCKET_IFNAME=" in said and "PET_LOCAL_ADDR=" in said
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")      # every rank on this host: no trap
    assert network.worker_check("node1", resolver=DEBIAN.get) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # the user chose the interface
    assert network.worker_check("node1", resolver=DEBIAN.get) is None


def test_the_interface_that_routes_somewhere_is_found():
    address = network.route_to("127.0.0.1")
    assert address == "127.0.0.1" and network.interface_of(address) == "lo"


@pytest.mark.parametrize("argv, host", [
    (["--nnodes", "2", "--rdzv_endpoint", "node0:29500", "train.py", "--nnodes", "1"],
     "node0"),
    (["--nnodes=1:2", "--rdzv-endpoint=[fd00::1]:29500", "train.py"], "fd00::1"),
    (["--nnodes", "2", "--master_addr", "node0", "train.py"], "node0"),
    (["--nnodes", "1", "--rdzv_endpoint", "node0:29500", "train.py"], None),
    (["--standalone", "--nproc_per_node", "2", "train.py", "--nnodes", "2"], None),
    (["--nproc_per_node", "2", "train.py", "--rdzv_endpoint", "x:1"], None),
])
def test_the_rendezvous_host_is_read_from_torchruns_own_arguments(argv, host, monkeypatch):
    for var in ("PET_NNODES", "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR", "PET_STANDALONE"):
        monkeypatch.delenv(var, raising=False)
    assert launch.endpoint_host(argv) == host


def test_the_launcher_picks_the_interface_or_stops_with_the_fix(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(network, "loopback_problem", lambda host: "PROBLEM")
    monkeypatch.setattr(network, "route_to", lambda host: "10.77.0.2")
    monkeypatch.setattr(network, "interface_of", lambda address: "veth7")
    said = []
    argv = ["--nnodes", "2", "--rdzv_endpoint", "node0:29500", "train.py"]
    assert launch.prepare_network(argv, log=said.append) == ["--local-addr", "10.77.0.2",
                                                             *argv]
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "veth7"
    assert said == ["megalite: PROBLEM; using interface veth7 (10.77.0.2), the one that "
                    "routes to node0: GLOO_SOCKET_IFNAME=veth7, NCCL_SOCKET_IFNAME=veth7, "
                    "--local-addr 10.77.0.2 (set them yourself to choose another; "
                    "MEGALITE_PICK_INTERFACE=0 stops instead)"]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MEGALITE_PICK_INTERFACE", "0")
    with pytest.raises(SystemExit) as stop:
        launch.prepare_network(argv, log=said.append)
    assert stop.value.code == 2
    assert said[-1].startswith("megalite: error: PROBLEM; set GLOO_SOCKET_IFNAME=veth7 "
                               "(NCCL_SOCKET_IFNAME=veth7 on GPUs) and PET_LOCAL_ADDR=10.77.0.2")


def test_the_launcher_turns_off_the_shared_rendezvous_store():
    """What the workers see: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a replaced node can
    rejoin), so they meet on their own store, not the agent's."""
    code = ("import os; print(os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE'), "
            "os.environ.get('TORCHELASTIC_USE_AGENT_STORE'))")
    env = {k: v for k, v in os.environ.items() if k != launch.SHARE_STORE_VAR}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "megalite.launch", "--nnodes", "1",
                          "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                          "--rdzv_endpoint", f"127.0.0.1:{port}", "--no-python",
                          sys.executable, "-c", code],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "False"], out.stdout


def test_the_rendezvous_server_serves_a_store_until_stopped():
    import datetime
    import threading

    import torch.distributed as dist

    from megalite import rendezvous_server

    ports, stop = [], threading.Event()
    server = threading.Thread(target=rendezvous_server.serve, args=(0, ports.append, stop))
    server.start()
    try:
        deadline = 30
        while not ports and deadline > 0:
            server.join(0.1)
            deadline -= 0.1
        client = dist.TCPStore("127.0.0.1", ports[0], is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("/torch.rendezvous.job/state", "x")
        other = dist.TCPStore("127.0.0.1", ports[0], is_master=False,
                              timeout=datetime.timedelta(seconds=10))
        assert other.get("/torch.rendezvous.job/state") == b"x"
    finally:
        stop.set()
        server.join(10)
    assert not server.is_alive()
