"""Signals as Megatron-LM has them: ``--exit-signal`` picks the signal
``--exit-signal-handler`` saves and stops on, Ctrl-C (SIGINT to every process of the job)
saves once under the handler and is one line per rank without it, and the launcher
(``python -m megalite.launch``, what the scripts run) ends without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from megalite.arguments import parse_args
from megalite.training.signals import SignalHandler, exit_signals
from tests.training.common import PYTHON, REPO, subprocess_env

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "10000", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--log-interval", "1",
        "--distributed-backend", "gloo"]


def test_exit_signal_is_a_flag_and_sigint_is_always_handled():
    assert parse_args(["--exit-signal", "SIGUSR1"]).train.exit_signal == "SIGUSR1"
    assert exit_signals("SIGUSR1") == (signal.SIGUSR1, signal.SIGINT)
    assert exit_signals("SIGINT") == (signal.SIGINT,)
    before = signal.getsignal(signal.SIGUSR1)
    with SignalHandler(sigs=exit_signals("SIGUSR1")) as handler:
        assert not handler.received
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.received
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN   # a repeat cannot kill it
    signal.signal(signal.SIGUSR1, before)
    with SignalHandler(enabled=False, sigs=exit_signals("SIGUSR1")) as handler:
        assert signal.getsignal(signal.SIGUSR1) == before


def _ctrl_c(flags: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """Two ranks under ``python -m megalite.launch`` in their own process group; SIGINT to
    the whole group once iteration 3 is logged, as a terminal's Ctrl-C does."""
    codes = tmp_path / "codes"
    codes.mkdir()
    proc = subprocess.Popen(
        [PYTHON, "-m", "megalite.launch", "--standalone", "--nproc_per_node", "2",
         "pretrain/pretrain_gpt.py", *TINY, *flags], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=subprocess_env(MEGALITE_EXIT_CODE_DIR=str(codes)))
    try:
        for line in proc.stdout:
            if "iteration        3/" in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    exit_codes = sorted(p.read_text().strip() for p in codes.iterdir())
    return subprocess.CompletedProcess(proc.args, proc.returncode, rest), exit_codes


@pytest.mark.parametrize("handler", [True, False], ids=["exit-signal-handler", "plain"])
def test_ctrl_c_saves_once_or_stops_with_one_line_per_rank(handler, tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--save", str(save), "--exit-signal-handler"] if handler else []
    out, exit_codes = _ctrl_c(flags, tmp_path)
    text = out.stdout
    assert "Traceback" not in text, text[-3000:]
    assert out.returncode == 130   # the launcher: 128 + SIGINT, after its workers
    assert "megalite: the launcher stopped on SIGINT once its workers had stopped" in text
    if handler:
        assert exit_codes == ["0", "0"]
        assert text.count("saved checkpoint at iteration") == 1, text[-3000:]
        assert (save / "latest_checkpointed_iteration.txt").exists()
    else:
        assert exit_codes == ["130", "130"]
        for r in (0, 1):   # the ranks' lines share one pipe: count, not split
            assert text.count(f"megalite: interrupted (rank {r}): stopped by SIGINT (Ctrl-C) "
                              "without saving; --exit-signal-handler saves a checkpoint on "
                              "it") == 1, text[-3000:]
