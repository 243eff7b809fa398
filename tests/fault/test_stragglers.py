"""--log-straggler: every log interval, each rank's times gathered and the slowest named.
Black-box: one of two ranks is slowed from outside (SIGSTOP/SIGCONT pulses, stopped four
fifths of the time); the log and the metrics JSONL must name it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megalite.training.straggler import line, report
from tests.training.common import read_jsonl, start_two_ranks, tiny_flags


def test_report_names_the_slowest_and_fastest_by_busy_time():
    # rank: [step, forward_backward, optimizer, comm] ms/iter; busy = step - comm
    rows = [[100.0, 20.0, 5.0, 70.0],    # busy 30: waits for the others
            [100.0, 80.0, 5.0, 10.0],    # busy 90: the straggler
            [100.0, 50.0, 5.0, 40.0],    # busy 60
            [100.0, 45.0, 5.0, 50.0]]    # busy 50
    rep = report(rows, count=2)
    assert rep["busy_ms"] == [30.0, 90.0, 60.0, 50.0]
    assert rep["slowest"] == [[1, 90.0], [2, 60.0]]
    assert rep["fastest"] == [[0, 30.0], [3, 50.0]]
    assert rep["slowest_vs_median"] == pytest.approx(90.0 / 55.0, abs=1e-3)
    text = line(20, rep)
    assert "busy (ms/iter) min 30.0 (rank 0) median 55.0 max 90.0 (rank 1)" in text
    assert "slowest: rank 1 90.0 ms (+64% vs median; step 100.0: fwd-bwd 80.0" in text
    assert text.endswith("fastest: rank 0 30.0 ms, rank 3 50.0 ms")
    assert report(rows, count=9)["slowest"][-1] == [0, 30.0]   # capped at the world


def _pulse(pid: int, stop: threading.Event, started) -> None:
    """Once ``started`` exists (training began), keep ``pid`` stopped four fifths of the
    time until ``stop`` (or it exits)."""
    while not started.exists() and not stop.wait(0.05):
        pass
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.04)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_slowed_rank_is_named(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    flags = tiny_flags(**{"--train-iters": 40, "--log-interval": 10, "--log-straggler": True,
                          "--disable-straggler-on-startup": True,
                          "--metrics-jsonl": str(metrics)})
    procs = start_two_ranks(flags)
    stop = threading.Event()
    pulser = threading.Thread(target=_pulse, args=(procs[0].pid, stop, metrics), daemon=True)
    pulser.start()
    outs = {}
    readers = [threading.Thread(target=lambda r=r: outs.update({r: procs[r].communicate(
        timeout=300)})) for r in range(2)]
    try:
        for t in readers:
            t.start()
        for t in readers:
            t.join()
    finally:
        stop.set()
        pulser.join()
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [ln for ln in outs[1][0].splitlines() if ln.startswith(" straggler |")]
    reports = {r["iteration"]: r["straggler"] for r in read_jsonl(metrics) if "straggler" in r}
    assert sorted(reports) == [20, 30, 40]     # the first interval left out (start-up)
    assert len(lines) == 3
    named = [rep["slowest"][0][0] for rep in reports.values()]
    assert named.count(0) >= 2, reports          # a loaded machine may blur one interval
    assert sum("slowest: rank 0 " in ln for ln in lines) >= 2, lines
    for rep in reports.values():
        assert len(rep["step_ms"]) == 2 and len(rep["comm_ms"]) == 2
    # stopped most of the time: clearly busier than its peer, which waits for it
    assert sum(rep["busy_ms"][0] > 1.2 * rep["busy_ms"][1] for rep in reports.values()) >= 2
