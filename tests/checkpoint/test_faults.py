"""Checkpoint faults a user hits, each one line naming the fault and the fix: another run's
checkpoints in ``--save``, a damaged pointer or iteration (the newest good
``--ckpt-step``), a full disk during a save (tmpfs), and the lock released on every exit."""

import os
import signal
import subprocess
import time

import pytest

from megalite.checkpoint import CheckpointError, read_latest_iteration
from megalite.checkpoint.lock import LOCK
from tests.checkpoint.conftest import copy_checkpoints, load_iteration
from tests.training.common import (
    ENTRYPOINT,
    PYTHON,
    read_jsonl,
    run_training,
    start_two_ranks,
    subprocess_env,
    tiny_config,
    tiny_flags,
)


def _entrypoint(*flags, **overrides) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, ENTRYPOINT, *tiny_flags(**overrides), *flags],
                          env=subprocess_env(), capture_output=True, text=True, timeout=150,
                          check=False)


def _one_line(proc, code: int, rank: int = 0) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"megalite: error (rank {rank}): "), lines
    return lines[0]


# -- another run's checkpoints in --save ----------------------------------------------------
def test_a_fresh_run_refuses_another_runs_checkpoints_on_every_rank(saved, tmp_path):
    root = copy_checkpoints(saved, tmp_path)
    before = sorted(os.listdir(root))
    procs = start_two_ranks(tiny_flags(**{"--save": root, "--save-interval": 2}))
    results = [(p.communicate(timeout=150)[1], p.returncode) for p in procs]
    for rank, (stderr, code) in enumerate(results):
        lines = stderr.strip().splitlines()
        assert code == 4 and len(lines) == 1, results
        assert lines[0].startswith(f"megalite: error (rank {rank}): "), lines
        for words in (f"--save {root} already holds the checkpoints of a run (up to "
                      "iteration 4: 2 iteration directories, 2 to 4)", "(no --load)",
                      f"pass --load {root}", "choose another --save",
                      "--overwrite-checkpoints"):
            assert words in lines[0], lines
    assert sorted(os.listdir(root)) == before and read_latest_iteration(root) == 4


def test_load_elsewhere_is_refused_too_and_overwrite_deletes_the_old_run(saved, tmp_path):
    root = copy_checkpoints(saved, tmp_path)
    with pytest.raises(CheckpointError, match=rf"does not resume \(--load {saved}\)"):
        run_training(tiny_config(train={"train_iters": 2},
                                 checkpoint={"save": root, "load": saved, "save_interval": 2}))
    assert not os.path.exists(os.path.join(root, LOCK))
    run_training(tiny_config(train={"train_iters": 2}, checkpoint={
        "save": root, "save_interval": 2, "overwrite_checkpoints": True}))
    assert sorted(os.listdir(root)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert read_latest_iteration(root) == 2


def test_resume_from_the_save_directory_is_not_refused(saved, tmp_path):
    root = copy_checkpoints(saved, tmp_path)
    result, _ = run_training(tiny_config(train={"train_iters": 6}, checkpoint={
        "save": root, "load": root, "save_interval": 2}))
    assert result.iteration == 6 and read_latest_iteration(root) == 6
    os.makedirs(tmp_path / "crashed" / "iter_0000002.tmp")   # no finished save: not a run
    run_training(tiny_config(train={"train_iters": 2}, checkpoint={
        "save": str(tmp_path / "crashed"), "save_interval": 2}))
    assert read_latest_iteration(str(tmp_path / "crashed")) == 2


# -- a damaged pointer or iteration names the newest good --ckpt-step -----------------------
_POINTER = {
    "garbage": (b"garbage", "found 'garbage'"),
    "not text": (b"\xff\xfe\x00\x81", r"found bytes that are not text"),
    "empty": (b"", "found nothing (it is empty)"),
    "release": (b"release", "'release', Megatron-LM's marker of a released checkpoint"),
    "99": (b"99", "iter_0000099 does not exist (latest_checkpointed_iteration.txt names "
                  "iteration 99)"),
}


@pytest.mark.parametrize("case", sorted(_POINTER))
def test_a_bad_pointer_names_the_newest_good_checkpoint(saved, tmp_path, case):
    root = copy_checkpoints(saved, tmp_path)
    content, words = _POINTER[case]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointError) as err:
        load_iteration(load=root)
    assert words in str(err.value)
    assert str(err.value).endswith("the newest complete checkpoint there is iteration 4 "
                                   "(also: 2): load it with --ckpt-step 4"), str(err.value)
    assert load_iteration(load=root, ckpt_step=4) == 4


def test_a_pointer_that_is_not_text_is_one_line_exit_4(saved, tmp_path):
    root = copy_checkpoints(saved, tmp_path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "wb") as f:
        f.write(b"\xff\xfe\x00\x81")
    line = _one_line(_entrypoint(**{"--load": root}), 4)
    assert "found bytes that are not text" in line and line.endswith("--ckpt-step 4"), line


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


_DAMAGE = {
    "truncated shard": ("__0_0.distcp", _truncate, "is damaged: "),
    "deleted .metadata": (".metadata", os.remove, ".metadata is missing"),
    "truncated metadata.json": ("metadata.json", _truncate, "metadata.json is damaged"),
}


@pytest.mark.parametrize("case", sorted(_DAMAGE))
def test_a_damaged_latest_names_the_older_good_checkpoint(saved, tmp_path, case):
    root = copy_checkpoints(saved, tmp_path)
    name, damage, words = _DAMAGE[case]
    damage(os.path.join(root, "iter_0000004", name))
    with pytest.raises(CheckpointError) as err:
        load_iteration(load=root)
    assert words in str(err.value) and "--ckpt-step 2" in str(err.value), str(err.value)
    assert "--no-ckpt-verify" not in str(err.value)   # sizes are checked without it too
    assert load_iteration(load=root, ckpt_step=2) == 2
    damage(os.path.join(root, "iter_0000002", name))
    with pytest.raises(CheckpointError, match="no (older )?complete checkpoint exists"):
        load_iteration(load=root)


def test_a_damaged_shard_is_one_line_without_a_stray_prefix_and_the_lock_goes(saved,
                                                                              tmp_path):
    """Exit 4 from the load of a --load D --save D run: one line, no "here:" before the
    fault, the fix named, and the --save lock released."""
    root = copy_checkpoints(saved, tmp_path)
    shard = os.path.join(root, "iter_0000004", "__0_0.distcp")
    size = os.path.getsize(shard)
    _truncate(shard)
    line = _one_line(_entrypoint(**{"--load": root, "--save": root, "--save-interval": 2}), 4)
    assert line == (f"megalite: error (rank 0): checkpoint file {shard} is damaged: "
                    f"{size // 2} bytes, the manifest says {size} (truncated?); the newest "
                    "older complete checkpoint is iteration 2: load it with --ckpt-step 2")
    assert not os.path.exists(os.path.join(root, LOCK))


def test_sigterm_releases_the_lock(tmp_path):
    """Without --exit-signal-handler SIGTERM still ends the run (killed by the signal), and
    the lock goes with it."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    proc = subprocess.Popen([PYTHON, ENTRYPOINT, *tiny_flags(**{
        "--train-iters": 100000, "--save": save, "--metrics-jsonl": metrics,
        "--log-interval": 1000})], env=subprocess_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(metrics) and read_jsonl(metrics)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert os.path.exists(os.path.join(save, LOCK))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert not os.path.exists(os.path.join(save, LOCK))


# -- a full disk during a save --------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A mount point whose ``mount(size)`` mounts a tmpfs of that size (unmounted after)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = []

    def mount(size: str) -> str:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return str(where)

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_at_the_first_save(small_disk):
    root = os.path.join(small_disk("256k"), "ckpt")
    with pytest.raises(CheckpointError) as err:
        run_training(tiny_config(train={"train_iters": 2},
                                 checkpoint={"save": root, "save_interval": 1}))
    message = str(err.value)
    assert message.startswith(f"saving iteration 1 to {root} failed: no space left on "
                              "device ("), message
    assert "free there, a checkpoint needs about " in message, message
    assert ("the partial iter_0000001.tmp was removed; no earlier checkpoint exists there; "
            "free space there or choose another --save") in message, message
    assert os.listdir(root) == []


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_at_a_later_save_keeps_the_previous_one(small_disk, async_save):
    """The second checkpoint does not fit: one line (exit 4) naming the space, the partial
    directory removed, the first checkpoint intact and still loadable."""
    root = os.path.join(small_disk("1m"), "ckpt")
    proc = _entrypoint("--save", root, "--save-interval", "1",
                       **{"--train-iters": 2, "--async-save": async_save})
    line = _one_line(proc, 4)
    assert f"saving iteration 2 to {root} failed: no space left on device (" in line, line
    assert ("the partial iter_0000002.tmp was removed; the previous checkpoint, iteration 1, "
            "is intact (latest_checkpointed_iteration.txt still names it)") in line, line
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert load_iteration(load=root, no_load_rng=True) == 1
