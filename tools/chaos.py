#!/usr/bin/env python3
"""Kill training workers under torchrun and check that the job finishes as if nothing happened.

Runs a tiny GPT twice with ``torchrun --max-restarts K`` and ``--save/--load`` on one
directory: once undisturbed (the reference), once while this script SIGKILLs a random
worker K times at random moments (between iterations, during a save, right after a
restart). torchrun restarts the workers each time; they resume from the latest complete
checkpoint by themselves. The final per-iteration losses and gradient norms (the last
value logged for each iteration) must equal the reference's bit for bit.

    python tools/chaos.py --kills 10 --seed 3          # what `make chaos` runs
    python tools/chaos.py --kills 2 --train-iters 16   # the quick version the tests run

Prints one line per kill, then a summary: kills survived, restarts (new worker generations;
how many resumed from a checkpoint rather than from scratch), the wall time of both
runs and the restart overhead per failure. Exit code 0 when the curves match.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NPROC = 2   # workers per job (tp = 2)


def model_flags(out: Path, train_iters: int, save_interval: int) -> list[str]:
    """A 2-layer Llama-style model, tp = 2 over the two workers, on the bundled corpus."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--data-path", str(REPO / "data" / "kjv_text_document"), "--split", "98,2,0",
        "--tokenizer-type", "GPTSentencePieceTokenizer",
        "--tokenizer-model", str(REPO / "data" / "kjv_bpe_8k.model"),
        "--tensor-model-parallel-size", "2", "--distributed-backend", "gloo",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(train_iters),
        "--lr", "3e-3", "--eval-interval", "1000", "--eval-iters", "1",
        "--save", str(out / "ckpt"), "--load", str(out / "ckpt"),
        "--save-interval", str(save_interval), "--log-interval", "1",
        "--metrics-jsonl", str(out / "metrics.jsonl"),
    ]


def final_curve(path: Path) -> dict[int, tuple[float, float]]:
    """iteration -> (lm_loss, grad_norm), the last line logged for each iteration."""
    curve = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "lm_loss" in row:
                curve[row["iteration"]] = (row["lm_loss"], row["grad_norm"])
    return curve


def _lines(path: Path) -> int:
    try:
        return sum(1 for _ in path.open())
    except OSError:
        return 0


def run(out: Path, args, kills: int, rng: random.Random) -> dict:
    """One torchrun job; SIGKILL a random worker ``kills`` times. Returns its record."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(NPROC), "--max-restarts", str(kills),
           str(REPO / "pretrain" / "pretrain_gpt.py"),
           *model_flags(out, args.train_iters, args.save_interval)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with (out / "log").open("w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                               cwd=REPO, start_new_session=True)
        done = []
        try:
            for k in range(kills):
                # a kill after 1..iters/(kills+1) more logged iterations (so all of them fit
                # in the run), at a random offset in time
                gap = max(1, args.train_iters // (kills + 1))
                target = _lines(out / "metrics.jsonl") + rng.randint(1, gap)
                while job.poll() is None and _lines(out / "metrics.jsonl") < target:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.3))   # sometimes lands inside a save
                workers = _children(job.pid)
                if job.poll() is not None or not workers:
                    break
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                done.append({"kill": k + 1, "pid": victim,
                             "after_lines": _lines(out / "metrics.jsonl"),
                             "at_s": round(time.monotonic() - start, 2)})
                print(f"  kill {k + 1}: worker {victim} after "
                      f"{done[-1]['after_lines']} logged iterations", flush=True)
                # the next kill only hits the restarted generation, however slow the host
                done[-1]["restarted"] = _await_new_generation(job, set(workers),
                                                              start + args.timeout)
            rc = job.wait(timeout=max(1.0, start + args.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            rc = "timeout"
    return {"rc": rc, "kills": done, "wall_s": time.monotonic() - start,
            "curve": final_curve(out / "metrics.jsonl")}


def _await_new_generation(job, killed_generation: set[int], deadline: float) -> bool:
    """Wait until torchrun has started a whole new set of workers (none of
    ``killed_generation`` left among its children). False when the job ended or the
    deadline passed first."""
    while time.monotonic() < deadline and job.poll() is None:
        now = set(_children(job.pid))
        if len(now) == NPROC and not now & killed_generation:
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[int]:
    """The worker processes torchrun started (its direct children)."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10, help="workers to SIGKILL (one at a time)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the clock)")
    p.add_argument("--train-iters", type=int, default=120)
    p.add_argument("--save-interval", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--out", type=Path, default=Path("runs/chaos"))
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"chaos: {args.kills} kills, seed {seed}, {args.train_iters} iterations, "
          f"save every {args.save_interval}", flush=True)
    reference = run(args.out / "reference", args, 0, random.Random(seed))
    chaos = run(args.out / "chaos", args, args.kills, random.Random(seed))
    restarts = sum(k.get("restarted", False) for k in chaos["kills"])
    resumes = (args.out / "chaos" / "log").read_text().count(" loaded ")
    same = chaos["curve"] == reference["curve"] and len(reference["curve"]) == args.train_iters
    survived = len(chaos["kills"]) if chaos["rc"] == 0 else 0
    overhead = (chaos["wall_s"] - reference["wall_s"]) / max(1, len(chaos["kills"]))
    print(f"chaos: exit {chaos['rc']} (reference {reference['rc']}); kills survived "
          f"{survived}/{len(chaos['kills'])} (of {args.kills} requested); restarts {restarts} "
          f"({resumes} from a checkpoint); curve "
          f"{'bit-identical' if same else 'DIFFERENT'} over {len(chaos['curve'])} iterations; "
          f"wall {chaos['wall_s']:.1f} s vs {reference['wall_s']:.1f} s "
          f"({overhead:.1f} s per failure)", flush=True)
    summary = {k: v for k, v in chaos.items() if k != "curve"}
    summary.update(seed=seed, same_curve=same, restarts=restarts, resumes=resumes,
                   reference_wall_s=reference["wall_s"], overhead_per_failure_s=overhead)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    all_made = len(chaos["kills"]) == args.kills
    return 0 if same and all_made and chaos["rc"] == 0 and reference["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
