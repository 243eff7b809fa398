"""torchrun restarts: a fresh store per attempt, and kills survived with the same curve."""

from __future__ import annotations

import datetime
import json
import socket
import threading

import pytest
import torch.distributed as dist

from megalite.parallel import rendezvous
from tests.tools import load_tool

TIMEOUT = datetime.timedelta(seconds=30)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attempt_store_skips_an_earlier_attempts_address(monkeypatch):
    """A rank that reads the previous attempt's address (its server is gone) waits for the
    new rank 0's store and accepts it only when the nonce matches."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    agent.set(rendezvous.ELASTIC_ADDRESS_KEY, f"127.0.0.1:{_dead_port()}:stale")
    got = {}
    follower = threading.Thread(target=lambda: got.update(store=rendezvous.attempt_store(
        1, TIMEOUT)))
    follower.start()
    follower.join(1.0)
    assert follower.is_alive(), "rank 1 accepted a dead address"
    leader = rendezvous.attempt_store(0, TIMEOUT)
    follower.join(20)
    assert not follower.is_alive()
    got["store"].set("from-rank-1", "hello")
    assert leader.get("from-rank-1") == b"hello"
    # the agent's store never saw the attempt's own keys
    assert agent.check(["from-rank-1"]) is False


def test_attempt_store_rejects_a_live_store_of_another_attempt(monkeypatch):
    """A server that answers but holds another nonce (a reused port) is not taken."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    other.set("megalite/attempt-nonce", "someone-else")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    agent.set(rendezvous.ELASTIC_ADDRESS_KEY, f"127.0.0.1:{other.port}:mine")
    with pytest.raises(TimeoutError, match="no store of this torchrun attempt"):
        rendezvous.attempt_store(1, datetime.timedelta(seconds=3))


def test_workers_killed_under_torchrun_finish_with_the_uninterrupted_curve(tmp_path):
    """Two SIGKILLs of random workers at random moments: torchrun restarts them, they
    resume from the latest complete checkpoint, and every iteration's loss and gradient
    norm equal the undisturbed run's."""
    chaos = load_tool("chaos")
    code = chaos.main(["--kills", "2", "--seed", "7", "--train-iters", "10",
                       "--save-interval", "2", "--timeout", "300", "--out", str(tmp_path)])
    summary = (tmp_path / "summary.json").read_text()
    assert code == 0, summary
    record = json.loads(summary)
    assert len(record["kills"]) == 2 and record["same_curve"] and record["restarts"] == 2
