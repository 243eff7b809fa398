"""scripts/pretrain_slurm.sbatch: trains a tiny model on 2 CPU ranks, and a SIGTERM to the
job step (what ``#SBATCH --signal=TERM@300`` or ``scancel --signal=TERM`` sends) ends in
a checkpoint of the last iteration and exit 0; resubmitting resumes from it.

Two ways: under a stand-in ``srun``/``scontrol`` (always: the script's environment
handling, the step in its own process group as slurmstepd starts it), and under a real
one-node SLURM (slurmctld + slurmd started in a temporary directory; slow, and skipped
where SLURM is not installed or the test is not root)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from megalite.checkpoint import read_latest_iteration
from megalite.checkpoint.lock import LOCK
from tests.training.common import REPO, read_jsonl, subprocess_env

SCRIPT = os.path.join(REPO, "scripts", "pretrain_slurm.sbatch")

FAKE_SRUN = """#!/usr/bin/env bash
# srun stand-in: drops srun's own options, records its pid, and runs the task in a new
# session (its own process group), as slurmstepd does
while [[ "${1:-}" == -* ]]; do shift; done
echo $$ > "$FAKE_SRUN_PIDFILE"
export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_NTASKS=1 SLURM_STEP_ID=0
exec setsid "$@"
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol stand-in: only `scontrol show hostnames LIST` (a comma-separated list here)
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: $*" >&2; exit 1; }
tr ',' '\\n' <<< "$3"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_job_env(out, train_iters: int, **extra) -> dict:
    """What a user exports before ``sbatch`` for the tiny CPU run (the script's header)."""
    return subprocess_env(
        NPROC_PER_NODE="2", TP="2", PYTHON=sys.executable,
        MODEL_ARGS="--num-layers 2 --hidden-size 32 --num-attention-heads 4 "
                   "--make-vocab-size-divisible-by 64",
        DATA_PATH="data/kjv_text_document", TOKENIZER_TYPE="GPTSentencePieceTokenizer",
        TOKENIZER_MODEL="data/kjv_bpe_8k.model", SEQ_LEN="32", MICRO_BATCH="2",
        GLOBAL_BATCH="4", TRAIN_ITERS=str(train_iters), SAVE_INTERVAL="1000",
        CHECKPOINT_DIR=str(out / "ckpt"), RUN_DIR=str(out / "run"),
        MASTER_PORT=str(free_port()), **extra)


EXTRA_FLAGS = ["--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "2"]


def wait_for(predicate, what: str, timeout: float = 240, alive=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if alive is not None:
            alive()
        time.sleep(0.3)


def logged(out) -> list[dict]:
    path = out / "run" / "metrics.jsonl"
    return read_jsonl(str(path)) if path.exists() else []


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_batch_script(fake_slurm, out, train_iters: int, job_id: int) -> subprocess.Popen:
    env = tiny_job_env(out, train_iters, PATH=f"{fake_slurm}:{os.environ['PATH']}",
                       SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="localhost",
                       SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=REPO,
                       FAKE_SRUN_PIDFILE=str(out / "step.pid"))
    return subprocess.Popen(["bash", SCRIPT, *EXTRA_FLAGS], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(out),
                            start_new_session=True)


def test_sbatch_script_trains_and_saves_on_sigterm_under_a_fake_srun(fake_slurm, tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    proc = run_batch_script(fake_slurm, out, 100000, 11)
    try:
        def alive():
            assert proc.poll() is None, proc.communicate()[0][-4000:]

        wait_for(lambda: len(logged(out)) >= 2, "two logged iterations", alive=alive)
        # slurmstepd signals the step's process group: the srun task (the exit-code
        # wrapper) and torchrun; torchrun and the wrapper both pass it to the workers
        os.killpg(int((out / "step.pid").read_text()), signal.SIGTERM)
        output = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output[-4000:]
    last = logged(out)[-1]["iteration"]
    assert read_latest_iteration(str(out / "ckpt")) == last, output[-4000:]
    assert f"exiting at iteration {last}: signal" in output
    assert not (out / "ckpt" / LOCK).exists()  # released at the clean exit

    proc = run_batch_script(fake_slurm, out, last + 2, 12)   # resubmitted: resumes
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, output[-4000:]
    assert [r["iteration"] for r in logged(out)][-3:] == [last, last + 1, last + 2]
    assert f"loaded {out / 'ckpt'}/iter_{last:07d} (iteration {last}" in output


# -- a real one-node SLURM ------------------------------------------------------------------
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo")


def _slurm_conf(root, host: str) -> str:
    ctld, slurmd = free_port(), free_port()
    lines = [
        "ClusterName=megalitetest", f"SlurmctldHost={host}", "AuthType=auth/none",
        "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "KillWait=120", "MinJobAge=600",
        f"NodeName={host} CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=YES",
    ]
    path = os.path.join(root, "slurm.conf")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.fixture
def slurm_cluster(tmp_path):
    """A one-node SLURM (slurmctld + slurmd of this test only); its SLURM_CONF."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed here (no {', '.join(missing)}; on Debian: "
                    "apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("a private slurmd needs root here")
    root = str(tmp_path / "slurm")
    for d in ("state", "spool"):
        os.makedirs(os.path.join(root, d))
    host = socket.gethostname().split(".")[0]
    conf = _slurm_conf(root, host)
    env = dict(os.environ, SLURM_CONF=conf)
    started = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            extra = ["-c"] if daemon == "slurmctld" else []
            subprocess.run([daemon, *extra, "-f", conf], env=env, check=True, timeout=60)
            pidfile = os.path.join(root, f"{daemon}.pid")
            wait_for(lambda p=pidfile: os.path.exists(p) and os.path.getsize(p) > 0,
                     f"{daemon} to start", timeout=60)
            started.append(int(open(pidfile).read()))

        def idle() -> bool:
            info = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                  text=True)
            return info.stdout.strip() == "idle"

        wait_for(idle, "the node to be idle", timeout=60)
        yield env
    finally:
        for pid in reversed(started):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _job(env, job_id: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                          text=True).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def _sbatch(env, out, train_iters: int) -> str:
    job_env = dict(tiny_job_env(out, train_iters), SLURM_CONF=env["SLURM_CONF"])
    done = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0",
                           f"--cpus-per-task={os.cpu_count() or 1}", "--time=20",
                           f"--output={out}/slurm-%j.out", SCRIPT, *EXTRA_FLAGS],
                          env=job_env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _finished(env, job_id: str, out) -> dict:
    def done() -> bool:
        return _job(env, job_id).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING")

    wait_for(done, f"job {job_id} to end", timeout=300)
    job = _job(env, job_id)
    job["output"] = (out / f"slurm-{job_id}.out").read_text()
    return job


@pytest.mark.slow
def test_sbatch_under_a_real_slurm_saves_on_scancel_and_resumes(slurm_cluster, tmp_path):
    env, out = slurm_cluster, tmp_path / "job"
    out.mkdir()
    job_id = _sbatch(env, out, 100000)
    wait_for(lambda: len(logged(out)) >= 2, "two logged iterations",
             alive=lambda: _job(env, job_id).get("JobState") in ("PENDING", "RUNNING"))
    subprocess.run(["scancel", "--signal=TERM", job_id], env=env, check=True)
    job = _finished(env, job_id, out)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job["output"][-4000:]
    last = logged(out)[-1]["iteration"]
    assert read_latest_iteration(str(out / "ckpt")) == last, job["output"][-4000:]
    assert not (out / "ckpt" / LOCK).exists()

    job = _finished(env, _sbatch(env, out, last + 2), out)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job["output"][-4000:]
    assert [r["iteration"] for r in logged(out)][-3:] == [last, last + 1, last + 2]
