"""Ranks agree on what they load, checksums are verified by default, ``--ckpt-step``, and
one job per ``--save`` directory (issue 15, items 1 and 2)."""

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

import megalite.checkpoint.files as ckpt_files
import megalite.checkpoint.load as ckpt_load
from megalite.checkpoint import CheckpointError
from megalite.checkpoint.lock import LOCK, SaveLock
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of iterations 2 and 4 (one process)."""
    save = str(tmp_path_factory.mktemp("integrity") / "ckpt")
    run_training(tiny_config(train={"train_iters": 4},
                             checkpoint={"save": save, "save_interval": 2}))
    return save


def _copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst


def _load(world_size: int = 1, **checkpoint) -> int:
    """Build a tiny run that loads ``checkpoint``; the iteration it resumes at."""
    cfg = tiny_config(world_size, train={"train_iters": 4}, checkpoint=checkpoint)
    ps = ParallelState.build(cfg.parallel)
    try:
        c = build_components(cfg, ps, peak_probe_seconds=0.01)
        c.close()
        return c.state.iteration
    finally:
        ps.destroy()


def test_manifest_records_a_fast_checksum(saved):
    with open(os.path.join(saved, "iter_0000004", "metadata.json")) as f:
        meta = json.load(f)
    algorithm = ckpt_files.FAST_CHECKSUM
    assert meta["checksums"] == [algorithm]
    for name, entry in meta["files"].items():
        path = os.path.join(saved, "iter_0000004", name)
        assert entry[algorithm] == ckpt_files.fast_checksum(path) and "sha256" not in entry


# -- item 1: one decision for all ranks ------------------------------------------------------
def _load_on_ranks(rank, world_size, root, patch):
    """Rank 1 gets another view of ``root`` (``patch``); returns the loaded iteration or
    the error."""
    saved = (ckpt_files.read_latest_iteration, ckpt_load.read_metadata_bytes)
    if rank == 1 and patch == "latest":        # rank 1 would pick iteration 2
        ckpt_files.read_latest_iteration = lambda root: 2
    if rank == 1 and patch == "metadata":      # rank 1 reads another metadata.json
        ckpt_load.read_metadata_bytes = lambda d: saved[1](d) + b" "
    try:
        return _load(world_size, load=root)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    finally:
        ckpt_files.read_latest_iteration, ckpt_load.read_metadata_bytes = saved


def test_every_rank_loads_rank0s_choice(saved):
    assert run_distributed(2, _load_on_ranks, saved, "latest") == [4, 4]


def test_ranks_seeing_another_checkpoint_all_fail_with_one_error(saved):
    errors = run_distributed(2, _load_on_ranks, saved, "metadata")
    assert all(e.startswith("CheckpointError") for e in errors), errors
    assert all("iter_0000004 changed after rank 0 chose it: this rank reads another "
               "metadata.json" in e and "; 3 reads in a row" in e for e in errors), errors
    assert "on rank 1: " in errors[0] and "here: " in errors[1]


def test_ckpt_step_loads_an_older_iteration(saved):
    assert _load(load=saved, ckpt_step=2) == 2
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: .* no iteration 3 .*"
                                              r"available: 2, 4"):
        _load(load=saved, ckpt_step=3)


# -- item 2: checksums verified by default ---------------------------------------------------
def _flip(path: str, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (same size)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(count)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    assert os.path.getsize(path) == size


def test_flipped_bytes_name_the_file_and_the_fallback(saved, tmp_path):
    root = _copy(saved, tmp_path)
    shard = os.path.join(root, "iter_0000004", "__0_0.distcp")
    _flip(shard)
    with pytest.raises(CheckpointError) as err:
        _load(load=root)
    message = str(err.value)
    assert f"checkpoint file {shard} is damaged" in message
    assert "older complete checkpoint is iteration 2" in message
    assert "--ckpt-step 2" in message and "--no-ckpt-verify" in message
    assert _load(load=root, no_ckpt_verify=True) == 4       # as it is, on request
    assert _load(load=root, ckpt_step=2) == 2                # the fallback is intact


def test_damage_without_an_older_checkpoint_says_so(saved, tmp_path):
    root = _copy(saved, tmp_path)
    _flip(os.path.join(root, "iter_0000002", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match="no older complete checkpoint exists"):
        _load(load=root, ckpt_step=2)


# -- item 1: one job per --save directory ----------------------------------------------------
def _write_lock(root: str, pid: int, host: str | None = None, age: float = 0.0) -> str:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK)
    now = time.time()
    with open(path, "w") as f:
        json.dump({"host": host or socket.gethostname(), "pid": pid, "started": now - age,
                   "heartbeat": now - age}, f)
    return path


def _train_saving(root: str):
    return run_training(tiny_config(train={"train_iters": 2},
                                    checkpoint={"save": root, "save_interval": 2}))


def test_a_second_job_on_the_same_save_dir_fails(tmp_path):
    root = str(tmp_path / "ckpt")
    other = subprocess.Popen(["sleep", "60"])
    try:
        _write_lock(root, other.pid)
        with pytest.raises(CheckpointError, match=rf"in use by another job \(host "
                                                  rf"{socket.gethostname()}, pid {other.pid}"):
            _train_saving(root)
    finally:
        other.kill()
        other.wait()
    assert not os.path.exists(os.path.join(root, "iter_0000002"))


def test_stale_locks_are_taken_over_and_a_clean_exit_removes_the_lock(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    gone = subprocess.Popen(["true"])
    gone.wait()
    _write_lock(root, gone.pid)
    _train_saving(root)
    assert f"pid {gone.pid} no longer runs on this host" in capsys.readouterr().out
    assert os.path.exists(os.path.join(root, "iter_0000002"))
    assert not os.path.exists(os.path.join(root, LOCK))
    _write_lock(root, 1, host="elsewhere", age=3600)      # another host, no heartbeat
    lock = SaveLock.acquire(root, log=print)
    assert "heartbeat is 3600s old" in capsys.readouterr().out
    lock.refresh()
    lock.release()
    assert not os.path.exists(os.path.join(root, LOCK))


def test_a_lock_taken_over_is_not_refreshed_or_removed_by_its_old_holder(tmp_path):
    root = str(tmp_path / "ckpt")
    lock = SaveLock.acquire(root, log=print)
    _write_lock(root, 1, host="elsewhere")
    with pytest.raises(CheckpointError, match="another job took over"):
        lock.refresh()
    lock.release()
    assert os.path.exists(os.path.join(root, LOCK))
