"""Dead peers on another host (no /proc to read there) are named as gone: from the
address in gloo's broken-connection error, from a heartbeat that stopped over a few
intervals, or from one that no longer advances after the reset; a peer whose heartbeat
still advances is alive. The heartbeat interval scales with the timeout."""

from __future__ import annotations

import json
import threading
import time

import pytest

from megalite.parallel import watchdog
from megalite.parallel.watchdog import DistributedFaultError, FlightRecorder


class DictStore:
    """The three store calls the recorder makes, on a dict."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def _beat(store, rank, host, addr, done, age=0.0, interval=0.5):
    store.set(f"hb/{rank}", json.dumps({
        "time": time.time() - age, "pid": 999999, "host": host, "addrs": [addr],
        "interval": interval, "done": {"dp": done}, "inflight": []}))


def _recorder(tmp_path, store, interval=0.5, timeout_s=6.0) -> FlightRecorder:
    rec = FlightRecorder()
    rec.store, rec.rank, rec.interval, rec.timeout_s = store, 0, interval, timeout_s
    rec.dump_dir = str(tmp_path)
    return rec


def _fail(rec, exc) -> str:
    entry = rec.begin("dp", [0, 1], "all_reduce", [[4]])
    error = rec.fault(entry, exc)
    assert isinstance(error, DistributedFaultError)
    return str(error)


RESET = RuntimeError("[pair.cc:553] Connection closed by peer [10.77.0.2]:18339. This is "
                     "typically caused by a remote worker crashing.")


@pytest.mark.parametrize("timeout_s, interval", [(600, 5.0), (6, 0.5), (60, 0.5), (300, 2.5),
                                                 (7200, 5.0)])
def test_the_heartbeat_interval_scales_with_the_timeout(timeout_s, interval):
    assert watchdog.heartbeat_interval(timeout_s) == interval


def test_gloo_names_the_peer_that_reset_the_connection():
    assert watchdog.peer_address(RESET) == "10.77.0.2"
    assert watchdog.peer_address(RuntimeError("Timed out waiting 6000ms")) is None


def test_a_peer_whose_host_reset_the_connection_is_gone(tmp_path):
    store = DictStore()
    _beat(store, 1, "node1", "10.77.0.2", done=0)         # fresh, but its host reset
    started = time.monotonic()
    text = _fail(_recorder(tmp_path, store), RESET)
    assert time.monotonic() - started < 1.0               # no second look needed
    assert ("dp all_reduce #1 on ranks [0, 1] failed after" in text
            and "rank 1 on host node1 is gone (its connection from 10.77.0.2 was reset; "
                "its last heartbeat had dp #0 done)" in text), text


def test_a_peer_elsewhere_whose_heartbeat_stops_after_a_reset_is_gone(tmp_path):
    """The reset came through another address (a proxy, another interface): the peer's
    heartbeat looks fresh, so it is read again two intervals on; it did not advance."""
    store = DictStore()
    _beat(store, 1, "node1", "10.77.0.9", done=0, age=0.2)
    started = time.monotonic()
    text = _fail(_recorder(tmp_path, store), RESET)
    assert 0.5 < time.monotonic() - started < 3.0
    assert ("rank 1 on host node1 is gone (the connection was reset and its heartbeat "
            "stopped 1.") in text, text


def test_a_peer_elsewhere_whose_heartbeat_advances_is_alive(tmp_path):
    store = DictStore()
    stop = threading.Event()

    def beating():
        while not stop.is_set():
            _beat(store, 1, "node1", "10.77.0.9", done=0)
            stop.wait(0.25)

    beater = threading.Thread(target=beating)
    beater.start()
    try:
        text = _fail(_recorder(tmp_path, store), RESET)
    finally:
        stop.set()
        beater.join()
    assert "rank 1 is alive (heartbeat 0." in text and "but has not reached it" in text, text


def test_a_peer_elsewhere_silent_for_over_three_intervals_is_gone(tmp_path):
    """A timeout (not a reset): a heartbeat 18 s old under a 5 s interval is a dead rank,
    where the old 30 s interval called it alive."""
    store = DictStore()
    _beat(store, 1, "node1", "10.77.0.2", done=0, age=18.1, interval=5.0)
    text = _fail(_recorder(tmp_path, store, interval=5.0, timeout_s=600),
                 RuntimeError("Timed out waiting 600000ms for recv operation"))
    assert ("did not complete within" in text and "rank 1 on host node1 is gone (no heartbeat "
            "for 18.1 s, over 3 of its 5 s intervals; its last heartbeat had dp #0 done)"
            in text), text


class GoneStore(DictStore):
    def check(self, keys):
        raise RuntimeError("Connection refused")


def test_rank_0_whose_host_reset_the_connection_is_gone_with_its_store(tmp_path,
                                                                       monkeypatch):
    """The store lives in rank 0's process: when rank 0's host is lost, no heartbeat can
    be read, but the reset came from MASTER_ADDR's address."""
    monkeypatch.setenv("MASTER_ADDR", "10.77.0.2")
    rec = _recorder(tmp_path, GoneStore())
    rec.rank = 1
    entry = rec.begin("dp", [0, 1], "all_reduce", [[4]])
    text = str(rec.fault(entry, RESET))
    assert ("rank 0 on host 10.77.0.2 is gone (its connection from 10.77.0.2 was reset, "
            "and the job's store, which it served, with it)") in text, text


def test_a_peer_here_still_exiting_when_the_reset_comes_is_gone(tmp_path):
    """On this host a killed peer's sockets close before its process has left /proc (a
    loaded machine): it is looked at again, and is gone by then."""
    import socket
    import subprocess

    peer = subprocess.Popen(["sleep", "60"])
    store = DictStore()
    store.set("hb/1", json.dumps({
        "time": time.time(), "pid": peer.pid, "host": socket.gethostname(),
        "addrs": ["127.0.0.1"], "interval": 0.5, "done": {}, "inflight": []}))
    killer = threading.Timer(0.3, peer.kill)
    killer.start()
    try:
        rec = _recorder(tmp_path, store)
        entry = rec.begin("pp", [0, 1], "p2p recv<-1", [[4]], key="p2p")
        entry["peers"] = [1]
        text = str(rec.fault(entry, RuntimeError(
            "Read error [127.0.0.1]:8088: Connection reset by peer")))
    finally:
        killer.join()
        peer.wait()
    assert f"rank 1 is gone (process {peer.pid} exited; its last heartbeat" in text, text
