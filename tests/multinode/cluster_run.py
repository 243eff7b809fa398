"""Runs of ``scripts/pretrain_multi_node.sh`` on emulated hosts (:mod:`tests.multinode.netns`):
a tiny Llama-style model on the bundled corpus, one process per host, and what the tests
read back (the curve, when a log line appeared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "scripts" / "pretrain_multi_node.sh")
TINY = ("--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
        "--position-embedding-type rope --normalization RMSNorm --swiglu "
        "--disable-bias-linear")


def env(out: Path, nnodes: str, nproc: int, tp: int, iters: int, **extra) -> dict:
    """The script's settings for a run writing to ``out`` (shared by every host)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    base.update(
        PYTHONPATH=str(REPO), PYTHON=sys.executable, OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1", MEGALITE_DEVICE="cpu",
        NNODES=nnodes, NPROC_PER_NODE=str(nproc), TP=str(tp), MASTER_ADDR="node0",
        MODEL_ARGS=TINY, DATA_PATH=str(REPO / "data" / "kjv_text_document"),
        TOKENIZER_TYPE="GPTSentencePieceTokenizer",
        TOKENIZER_MODEL=str(REPO / "data" / "kjv_bpe_8k.model"),
        SEQ_LEN="32", MICRO_BATCH="2", GLOBAL_BATCH="8", TRAIN_ITERS=str(iters),
        SAVE_INTERVAL="2", LR="3e-3", CHECKPOINT_DIR=str(out / "ckpt"),
        RUN_DIR=str(out / "run"), PET_MONITOR_INTERVAL="0.5",
        PET_RDZV_CONF="join_timeout=120,last_call_timeout=3")
    base.update(extra)
    return base


FLAGS = ["--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "1",
         "--distributed-backend", "gloo", "--distributed-timeout-minutes", "1"]


def start(host, out: Path, log: str, **settings) -> subprocess.Popen:
    """The launch script on ``host``, its output appended to ``out/<log>``."""
    out.mkdir(parents=True, exist_ok=True)
    return host.start(["bash", SCRIPT, *FLAGS], str(out / log), env=env(out, **settings),
                      cwd=str(REPO))


def curve(out: Path) -> dict[int, tuple[float, float]]:
    """iteration -> (lm_loss, grad_norm), the last line logged for each (a line cut by a
    killed writer is skipped)."""
    found = {}
    path = out / "run" / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "lm_loss" in row:
                found[row["iteration"]] = (row["lm_loss"], row["grad_norm"])
    return found


def iterations_logged(out: Path) -> int:
    return len(curve(out))


def wait_for(predicate, timeout: float, what: str, procs=()) -> float:
    """Poll ``predicate`` until true; the time it became true. Fails after ``timeout``
    seconds, or when one of ``procs`` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a launcher exited {p.returncode} first")
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def log_has(out: Path, log: str, text: str, after: int = 0) -> bool:
    path = out / log
    return path.exists() and text in path.read_text(errors="replace")[after:]


def log_size(out: Path, log: str) -> int:
    path = out / log
    return len(path.read_text(errors="replace")) if path.exists() else 0


def tail(out: Path, *logs: str, n: int = 3000) -> str:
    return "\n".join(f"--- {log}\n" + (out / log).read_text(errors="replace")[-n:]
                     for log in logs if (out / log).exists())
