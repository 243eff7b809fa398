"""Exit codes and one-line errors (megalite.errors) of pretrain_gpt.py and the converter,
and the launch script's exit code 0 after a SIGTERM-triggered save. Real processes."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megalite.checkpoint import read_latest_iteration
from megalite.data.gpt_dataset import TokenIdError
from megalite.errors import (EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA, EXIT_NUMERICAL, exit_code_of,
                             report_error)
from tests.training.common import (
    ENTRYPOINT,
    PYTHON,
    REPO,
    read_jsonl,
    start_two_ranks,
    subprocess_env,
    tiny_flags,
)

CONVERTER = os.path.join(REPO, "tools", "convert_checkpoint.py")


def _two_ranks(flags):
    """Both ranks of a world of two as plain processes (torchrun reports any failure as
    its own exit code 1; the ranks' codes are what this checks)."""
    procs = start_two_ranks(flags)
    try:
        return [(p.communicate(timeout=150)[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_exit_code_table():
    from megalite.checkpoint import CheckpointError
    from megalite.config import ConfigError
    from megalite.data.builder import DataBuildError
    from megalite.training.loop import NonFiniteLossError

    assert exit_code_of(ConfigError("x")) == EXIT_CONFIG == 2
    assert exit_code_of(DataBuildError("x")) == EXIT_DATA == 3
    assert exit_code_of(CheckpointError("x")) == EXIT_CHECKPOINT == 4
    assert exit_code_of(NonFiniteLossError("x")) == EXIT_NUMERICAL == 5
    assert exit_code_of(ValueError("x")) is None


def test_data_error_one_line_per_rank_exit_3(tmp_path):
    flags = tiny_flags(**{"--data-path": str(tmp_path / "missing_prefix")})
    flags.remove("--mock-data")
    results = _two_ranks(flags)
    assert [code for _, code in results] == [3, 3], results
    for rank, (stderr, _) in enumerate(results):
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"megalite: error (rank {rank}): "), stderr
        assert lines[0].endswith(f"{tmp_path}/missing_prefix.idx: file not found (an indexed "
                                 f"dataset needs both missing_prefix.idx and "
                                 f"missing_prefix.bin)"), stderr


def test_checkpoint_error_exit_4_and_traceback_on_request(tmp_path):
    load = tmp_path / "ckpt"
    (load / "iter_0000002").mkdir(parents=True)   # a truncated save: no metadata
    (load / "latest_checkpointed_iteration.txt").write_text("2")
    flags = tiny_flags(**{"--load": str(load)})
    proc = subprocess.run([PYTHON, ENTRYPOINT, *flags], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"megalite: error (rank 0): {load}/iter_0000002/metadata.json is missing: "
        f"{load}/iter_0000002 is not a megalite checkpoint (or was damaged). Found: [] "
        f"(latest_checkpointed_iteration.txt names iteration 2); no complete checkpoint "
        f"exists under {load}"]
    proc = subprocess.run([PYTHON, ENTRYPOINT, *flags],
                          env=subprocess_env(MEGALITE_TRACEBACK="1"),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 4, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    assert "CheckpointError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("megalite: error (rank 0): ")


def test_config_error_exit_2(tmp_path):
    flags = tiny_flags(**{"--global-batch-size": 7})
    proc = subprocess.run([PYTHON, ENTRYPOINT, *flags], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        line for line in proc.stderr.strip().splitlines() if line.startswith("megalite: error")]
    assert "global_batch_size (7) must be divisible" in proc.stderr


def test_converter_errors_name_its_own_flags(tmp_path):
    foreign = tmp_path / "notckpt"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    for extra in ([], ["--iteration", "3"]):
        proc = subprocess.run([PYTHON, CONVERTER, "--source", "megalite", "--target", "hf",
                               "--load-dir", str(foreign), "--save-dir", str(tmp_path / "o"),
                               *extra], env=subprocess_env(), capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 4, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convert_checkpoint: error: "), lines
        for flag in ("--load ", "--save ", "--ckpt-step", "--finetune"):
            assert flag not in lines[0], lines
    assert "holds no megalite checkpoint" in subprocess.run(
        [PYTHON, CONVERTER, "--source", "megalite", "--target", "megalite-consolidated",
         "--load-dir", str(foreign), "--save-dir", str(tmp_path / "o")], env=subprocess_env(),
        capture_output=True, text=True, timeout=120, check=False).stderr


def test_launch_script_exits_with_the_workers_code_not_torchruns(tmp_path):
    """torchrun exits 1 when a worker fails; the script exits with the workers' code (2: a
    layout that does not divide), after one line per rank."""
    env = subprocess_env(OUT=str(tmp_path / "run"), TRAIN_ITERS="2", PYTHON=sys.executable)
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_tiny_cpu.sh"),
                           "--tensor-model-parallel-size", "3"], capture_output=True,
                          text=True, env=env, timeout=150, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "megalite: torchrun exited 1; the workers' exit code is 2" in done.stderr
    assert done.stderr.count("megalite: error (rank") == 2


@pytest.mark.parametrize("target", ["script", "process-group"])
def test_tiny_cpu_script_exits_zero_after_sigterm_save(tmp_path, target):
    """SIGTERM to the script (forwarded to the workers), or to every process of the job at
    once as SLURM does at the time limit (torchrun itself then exits 1): the workers save,
    and the script exits 0."""
    out = tmp_path / "run"
    env = subprocess_env(OUT=str(out), TRAIN_ITERS="100000", PYTHON=sys.executable,
                         SEQ_LEN="32", MICRO_BATCH="2", GLOBAL_BATCH="4")
    proc = subprocess.Popen(["bash", os.path.join(REPO, "scripts", "pretrain_tiny_cpu.sh"),
                             "--log-interval", "1", "--eval-iters", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 150
        while not (metrics.exists() and len(read_jsonl(str(metrics))) >= 1):
            assert time.monotonic() < deadline, "training did not start"
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        if target == "script":
            proc.send_signal(signal.SIGTERM)   # the script's pid, as a scheduler would
        else:
            os.killpg(proc.pid, signal.SIGTERM)   # script, torchrun and workers together
        output = proc.communicate(timeout=150)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    last = read_jsonl(str(metrics))[-1]["iteration"]
    assert read_latest_iteration(str(out / "checkpoints")) == last, output
    if target == "script":
        assert "SignalException" not in output and "Traceback" not in output, output


def test_converter_hf_side_errors_are_one_line_with_their_code(tmp_path):
    """An HF directory with a config but no weights: exit 4 (checkpoint); a target layout
    that does not divide the model: exit 2 (config). One line each, no traceback."""
    from transformers import LlamaConfig

    hf = tmp_path / "hf"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=64).save_pretrained(hf)
    cases = {4: ([], "holds neither model.safetensors"),
             2: (["--target-tensor-parallel-size", "3"], "the target layout does not fit")}
    for code, (extra, words) in cases.items():
        proc = subprocess.run([PYTHON, CONVERTER, "--source", "hf", "--target", "megalite",
                               "--load-dir", str(hf), "--save-dir", str(tmp_path / "o"),
                               *extra], env=subprocess_env(), capture_output=True, text=True,
                              timeout=120, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == code, proc.stderr
        assert len(lines) == 1 and lines[0].startswith("convert_checkpoint: error: ") \
            and words in lines[0], lines


class _BadIds(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise TokenIdError(f"token id 70000 at position 3 of document {i} of data/x is "
                           f"beyond the vocabulary (60)")


def test_a_data_error_raised_in_a_loader_worker_is_still_one_line():
    """With --num-workers > 0 the DataLoader re-raises a worker's error with the worker's
    traceback in the message; the report keeps the original sentence only."""
    loader = torch.utils.data.DataLoader(_BadIds(), num_workers=1)
    with pytest.raises(TokenIdError) as info:
        next(iter(loader))
    assert "Original Traceback" in str(info.value)   # what torch hands over
    out = io.StringIO()
    assert report_error(info.value, 0, file=out) == EXIT_DATA
    assert out.getvalue() == ("megalite: error (rank 0): token id 70000 at position 3 of "
                              "document 0 of data/x is beyond the vocabulary (60)\n")
