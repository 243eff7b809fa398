"""Hangs and dead ranks that name the rank, black-box: the entrypoint's ranks as plain
processes; one is paused with SIGSTOP or killed with SIGKILL from outside at iteration 3;
the live ranks must fail with exit code 8 and one line naming the group, the operation and
the rank that went away, soon after --distributed-timeout-minutes (0.1: 6 s), and leave
their flight recorder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from megalite.errors import EXIT_DISTRIBUTED
from tests.training.common import ENTRYPOINT, PYTHON, subprocess_env, tiny_flags

TIMEOUT_S = 6.0     # --distributed-timeout-minutes 0.1
SLACK_S = 30.0      # start-up of the live ranks' failure, exit, a loaded machine


def _start(world: int, flags: list[str]) -> list[subprocess.Popen]:
    """``world`` ranks of the entrypoint; the last one (which logs) has its stdout piped,
    the others' goes nowhere; every stderr is piped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [subprocess.Popen(
        [PYTHON, ENTRYPOINT, *flags], text=True, stderr=subprocess.PIPE,
        stdout=subprocess.PIPE if r == world - 1 else subprocess.DEVNULL,
        env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in range(world)]


def _fault_at_iteration(world: int, victim: int, sig: int, tmp_path, extra=None):
    """Run ``world`` ranks, send ``sig`` to rank ``victim`` once the logging rank printed
    iteration 3; returns ({rank: (exit code, stderr)} of the others, seconds from the
    signal to each one's exit)."""
    flags = tiny_flags(**{"--train-iters": 2000, "--distributed-timeout-minutes": 0.1,
                          "--metrics-jsonl": str(tmp_path / "run" / "metrics.jsonl"),
                          **(extra or {})})
    procs = _start(world, flags)
    logger = procs[-1]
    try:
        for line in logger.stdout:
            if "iteration        3/" in line:
                break
        else:
            pytest.fail("the run ended before iteration 3: "
                        + "".join(p.stderr.read()[-2000:] for p in procs))
        threading.Thread(target=logger.stdout.read, daemon=True).start()  # keep it draining
        signaled = time.monotonic()
        os.kill(procs[victim].pid, sig)
        results, seconds = {}, {}
        for r, p in enumerate(procs):
            if r == victim:
                continue
            err = p.communicate(timeout=TIMEOUT_S + SLACK_S + 60)[1]
            results[r] = (p.returncode, err)
            seconds[r] = time.monotonic() - signaled
        return results, seconds
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _error_line(err: str, rank: int) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"megalite: error (rank {rank}):")]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def _flight_recorder(line: str, tmp_path, rank: int = 0) -> dict:
    path = line.rsplit("flight recorder: ", 1)[1].strip()
    assert path == str(tmp_path / "run" / "flight_recorder" / f"rank{rank}.json")
    with open(path) as f:
        record = json.load(f)
    assert record["collectives"] and record["collectives"][-1]["end"] is None
    return record


def test_a_stopped_rank_is_named_after_the_timeout(tmp_path):
    results, seconds = _fault_at_iteration(2, 1, signal.SIGSTOP, tmp_path)
    code, err = results[0]
    assert code == EXIT_DISTRIBUTED, err[-3000:]
    line = _error_line(err, 0)
    assert "on ranks [0, 1] did not complete within" in line, line
    assert "(--distributed-timeout-minutes 0.1)" in line, line
    assert "rank 1 is stopped (no heartbeat for" in line, line
    record = _flight_recorder(line, tmp_path)
    stuck = record["collectives"][-1]
    assert f"{stuck['group']} {stuck['op']} #{stuck['seq']} on ranks [0, 1]" in line
    assert record["rank"] == 0 and record["timeout_s"] == pytest.approx(TIMEOUT_S)
    waited = float(line.split("did not complete within ")[1].split(" s")[0])
    assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + 5, line
    assert seconds[0] < TIMEOUT_S + SLACK_S, seconds


def test_a_killed_pipeline_stage_is_named_as_gone(tmp_path):
    """pp=2: the first stage waits in a pipeline transfer (or the embedding all-reduce)
    when the last stage is killed."""
    results, seconds = _fault_at_iteration(2, 1, signal.SIGKILL, tmp_path,
                                           {"--pipeline-model-parallel-size": 2})
    code, err = results[0]
    assert code == EXIT_DISTRIBUTED, err[-3000:]
    line = _error_line(err, 0)
    assert "pp p2p recv<-1 #" in line or "embedding all_reduce #" in line, line
    assert "on ranks [0, 1] failed after" in line, line
    assert "a peer closed the connection: rank 1 is gone (process " in line, line
    assert "Connection" not in line
    _flight_recorder(line, tmp_path)
    assert seconds[0] < TIMEOUT_S + SLACK_S, seconds   # no waiting for the timeout


@pytest.mark.slow
def test_a_stopped_rank_0_is_named_though_its_store_does_not_answer(tmp_path):
    """Rank 0 serves the job's c10d store: stopped, it takes the heartbeats with it; the
    peer still fails after the timeout (plus the bounded wait for the store) naming it."""
    results, seconds = _fault_at_iteration(2, 0, signal.SIGSTOP, tmp_path)
    code, err = results[1]
    assert code == EXIT_DISTRIBUTED, err[-3000:]
    line = _error_line(err, 1)
    assert "on ranks [0, 1] did not complete within" in line, line
    assert "rank 0 is not responding (the job's store, which it serves, did not answer" in line
    record = _flight_recorder(line, tmp_path, rank=1)
    assert record["rank"] == 1
    assert seconds[1] < TIMEOUT_S + SLACK_S, seconds


@pytest.mark.slow   # four ranks start slowly on a loaded 2-core machine (~25-65 s)
def test_four_ranks_tp2_dp2_every_live_rank_names_the_stopped_one(tmp_path):
    """Rank 3 stops: its tp peer (rank 2) times out in a tp collective, rank 1 in its dp
    collective with rank 3, and rank 0 (tp with rank 1) names rank 1 stuck in that dp
    collective, waiting for rank 3 (or rank 2 failing first, waiting for it)."""
    results, _ = _fault_at_iteration(4, 3, signal.SIGSTOP, tmp_path,
                                     {"--tensor-model-parallel-size": 2})
    lines = {}
    for r, (code, err) in results.items():
        assert code == EXIT_DISTRIBUTED, (r, err[-3000:])
        lines[r] = _error_line(err, r)
        assert "rank 3" in lines[r], lines[r]
    assert "distributed: tp " in lines[2] and "on ranks [2, 3]" in lines[2], lines[2]
    assert "rank 3 is stopped" in lines[2], lines[2]
    assert "on ranks [1, 3]" in lines[1], lines[1]
