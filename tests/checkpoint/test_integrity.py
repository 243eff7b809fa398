"""Ranks agree on what they load, checksums are verified by default, ``--ckpt-step``, and
one job per ``--save`` directory."""

import json
import os
import re
import socket
import subprocess
import threading
import time

import pytest

import megalite.checkpoint.files as ckpt_files
import megalite.checkpoint.load as ckpt_load
from megalite.checkpoint import CheckpointError
from megalite.checkpoint.lock import LOCK, SaveLock
from tests.distributed.harness import run_distributed
from tests.checkpoint.conftest import copy_checkpoints, load_iteration
from tests.training.common import run_training, tiny_config


def test_manifest_records_a_fast_checksum(saved):
    with open(os.path.join(saved, "iter_0000004", "metadata.json")) as f:
        meta = json.load(f)
    algorithm = ckpt_files.FAST_CHECKSUM
    assert meta["checksums"] == [algorithm]
    for name, entry in meta["files"].items():
        path = os.path.join(saved, "iter_0000004", name)
        assert entry[algorithm] == ckpt_files.fast_checksum(path) and "sha256" not in entry


# -- one decision for all ranks --------------------------------------------------------------
def _load_on_ranks(rank, world_size, root, patch):
    """Rank 1 gets another view of ``root`` (``patch``); returns the loaded iteration or
    the error."""
    saved = (ckpt_files.read_latest_iteration, ckpt_load.read_metadata_bytes)
    if rank == 1 and patch == "latest":        # rank 1 would pick iteration 2
        ckpt_files.read_latest_iteration = lambda root: 2
    if rank == 1 and patch == "metadata":      # rank 1 reads another metadata.json
        ckpt_load.read_metadata_bytes = lambda d: saved[1](d) + b" "
    try:
        return load_iteration(world_size, load=root)
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
    assert "on rank 1: " in errors[0] and errors[1].startswith(   # rank 1 names no rank
        "CheckpointError: " + os.path.join(saved, "iter_0000004"))


def test_ckpt_step_loads_an_older_iteration(saved):
    assert load_iteration(load=saved, ckpt_step=2) == 2
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: .* no iteration 3 .*"
                                              r"available: 2, 4"):
        load_iteration(load=saved, ckpt_step=3)


# -- checksums verified by default -----------------------------------------------------------
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
    root = copy_checkpoints(saved, tmp_path)
    shard = os.path.join(root, "iter_0000004", "__0_0.distcp")
    _flip(shard)
    with pytest.raises(CheckpointError) as err:
        load_iteration(load=root)
    message = str(err.value)
    assert f"checkpoint file {shard} is damaged" in message
    assert "older complete checkpoint is iteration 2" in message
    assert "--ckpt-step 2" in message and "--no-ckpt-verify" in message
    assert load_iteration(load=root, no_ckpt_verify=True) == 4       # as it is, on request
    assert load_iteration(load=root, ckpt_step=2) == 2                # the fallback is intact


def test_a_check_that_cannot_run_fails_the_load(saved, monkeypatch):
    """The hashing thread failing for any reason is not a pass: the load stops with one
    error naming the directory and the cause."""
    import megalite.checkpoint.verify as ckpt_verify

    def broken(*args, **kwargs):
        raise ValueError("mmap length is greater than file size")

    monkeypatch.setattr(ckpt_verify, "check_checksums", broken)
    with pytest.raises(CheckpointError, match=r"iter_0000004 could not be verified: "
                                              r"ValueError: mmap length"):
        load_iteration(load=saved)
    assert load_iteration(load=saved, no_ckpt_verify=True) == 4


def test_damage_without_an_older_checkpoint_says_so(saved, tmp_path):
    root = copy_checkpoints(saved, tmp_path)
    _flip(os.path.join(root, "iter_0000002", "__0_0.distcp"))
    with pytest.raises(CheckpointError, match="no older complete checkpoint exists"):
        load_iteration(load=root, ckpt_step=2)


# -- checksums verified beside DCP's read, on 2 ranks ----------------------------------
def _train_on_ranks(rank, world_size, root):
    run_training(tiny_config(world_size, train={"train_iters": 4},
                             checkpoint={"save": root, "save_interval": 2}))
    return rank


@pytest.fixture(scope="module")
def saved2(tmp_path_factory):
    """Checkpoints of iterations 2 and 4 saved by 2 ranks (dp 2: each rank's file holds
    half the weights, its optimizer shard and its RNG state)."""
    save = str(tmp_path_factory.mktemp("integrity2") / "ckpt")
    assert run_distributed(2, _train_on_ranks, save) == [0, 1]
    return save


def _load_or_error(rank, world_size, root, checkpoint):
    try:
        return load_iteration(world_size, load=root, **checkpoint)
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"


def _blob(iter_dir: str, name: str, key_prefix: str) -> tuple[int, int]:
    """(offset, length) in ``name`` of the largest saved blob whose key starts so."""
    from torch.distributed.checkpoint import FileSystemReader

    blobs = [(info.length, info.offset) for index, info in
             FileSystemReader(iter_dir).read_metadata().storage_data.items()
             if info.relative_path == name and index.fqn.startswith(key_prefix)]
    assert blobs, (name, key_prefix)
    length, offset = max(blobs)
    return offset, length


def _middle(iter_dir: str, name: str, key_prefix: str) -> int:
    offset, length = _blob(iter_dir, name, key_prefix)
    return offset + length // 2


def _invert(path: str, at: int, count: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(count)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _add_unread_file(iter_dir: str) -> str:
    """A file in the manifest that DCP never reads (no rank's plan names it)."""
    path = os.path.join(iter_dir, "extra.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(3 << 20))
    meta_path = os.path.join(iter_dir, "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    algorithm = ckpt_files.FAST_CHECKSUM
    meta["files"]["extra.bin"] = {"bytes": os.path.getsize(path),
                                  algorithm: ckpt_files.fast_checksum(path, algorithm)}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return path


def _at_end(path: str) -> int:
    return os.path.getsize(path) - 1


# damage -> (load flags, the damaged file, where in it). The thread beside DCP's read
# hashes every file a rank reads whole, so each place is found: a tensor's bytes, bytes
# DCP never reads (the last byte: a zip directory torch.load need not read; the RNG blob
# under --no-load-rng; the optimizer under --no-load-optim), bytes whose damage breaks
# torch.load (the first byte: the pickled common state; the thread still finishes), a
# file that no rank reads (hashed by one rank), and .metadata (checked before DCP reads
# it).
_DAMAGE = {
    "middle of a shard": ({}, "__1_0.distcp", lambda d, p: os.path.getsize(p) // 2),
    "middle of a tensor's bytes": ({}, "__0_0.distcp",
                                   lambda d, p: _middle(d, "__0_0.distcp", "model/")),
    "last byte of a shard": ({}, "__0_0.distcp", lambda d, p: _at_end(p)),
    "first byte of a shard": ({}, "__1_0.distcp", lambda d, p: 0),
    "RNG state not read (--no-load-rng)": ({"no_load_rng": True}, "__1_0.distcp",
                                           lambda d, p: _middle(d, "__1_0.distcp", "rng")),
    "optimizer state not read (--no-load-optim)": (
        {"no_load_optim": True}, "__0_0.distcp",
        lambda d, p: _middle(d, "__0_0.distcp", "optim/")),
    "a manifest file no rank reads": ({}, "extra.bin", lambda d, p: os.path.getsize(p) // 2),
    ".metadata": ({}, ".metadata", lambda d, p: 100),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_damage_found_while_reading_is_one_error_on_both_ranks(saved2, tmp_path, damage):
    """Checksums are verified beside DCP's read: wherever a file is damaged, every rank
    raises one error naming it and the fallback, before the load returns (no timing
    here: tools/benchmark.py checkpoint measures the cost)."""
    root = copy_checkpoints(saved2, tmp_path)
    iter_dir = os.path.join(root, "iter_0000004")
    flags, name, where = _DAMAGE[damage]
    if name == "extra.bin":
        _add_unread_file(iter_dir)
    assert run_distributed(2, _load_or_error, root, flags) == [4, 4]   # intact
    path = os.path.join(iter_dir, name)
    _invert(path, where(iter_dir, path))
    errors = run_distributed(2, _load_or_error, root, flags)
    for rank, error in enumerate(errors):
        assert error.startswith("CheckpointError: "), (rank, error)
        assert (f"checkpoint file {path} is damaged: its {ckpt_files.FAST_CHECKSUM} "
                "differs from the manifest's") in error, (rank, error)
        assert "older complete checkpoint is iteration 2" in error, (rank, error)
    core = [re.sub(r"^CheckpointError: (on rank \d: )?", "", e) for e in errors]
    assert core[0] == core[1]   # one error, named "on rank R" by the ranks it did not occur on
    assert run_distributed(2, _load_or_error, root, {**flags, "ckpt_step": 2}) == [2, 2]


def test_a_truncated_shard_is_named_on_both_ranks(saved2, tmp_path):
    root = copy_checkpoints(saved2, tmp_path)
    shard = os.path.join(root, "iter_0000004", "__1_0.distcp")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 1)
    errors = run_distributed(2, _load_or_error, root, {})
    for error in errors:
        assert (f"checkpoint file {shard} is damaged: {size - 1} bytes, the manifest says "
                f"{size} (truncated?)") in error, errors


# -- one job per --save directory ------------------------------------------------------------
def _write_lock(root: str, pid: int, host: str | None = None, age: float = 0.0,
                interval: float | None = None) -> str:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK)
    now = time.time()
    info = {"host": host or socket.gethostname(), "pid": pid, "started": now - age,
            "heartbeat": now - age}
    if interval is not None:
        info["interval"] = interval
    with open(path, "w") as f:
        json.dump(info, f)
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


def test_a_lock_of_a_lost_node_is_taken_over_after_a_few_of_its_intervals(tmp_path):
    """Another host's lock (its pid cannot be checked from here) whose heartbeat stopped
    for over 3 of its intervals is taken over at once, and the log says so; a fresher one
    is refused, naming the holder."""
    from megalite.checkpoint.lock import HEARTBEAT_SECONDS, STALE_INTERVALS

    root = str(tmp_path / "ckpt")
    _write_lock(root, 18378, host="node0", age=STALE_INTERVALS * HEARTBEAT_SECONDS + 5)
    said = []
    started = time.monotonic()
    lock = SaveLock.acquire(root, log=said.append)
    assert time.monotonic() - started < 2.0
    assert len(said) == 1 and said[0].startswith(
        f" taking over the lock {root}/{LOCK} of host node0 pid 18378: its heartbeat is 35s "
        f"old (over 30s, 3 of its 10s intervals): the holder is gone"), said
    assert json.load(open(os.path.join(root, LOCK)))["interval"] == HEARTBEAT_SECONDS
    lock.release()
    _write_lock(root, 18378, host="node0", age=5)      # on time: a live job elsewhere
    with pytest.raises(CheckpointError, match=r"in use by another job \(host node0, pid 18378, "
                                              r"heartbeat 5s ago\).*after 30s without"):
        SaveLock.acquire(root, log=said.append)


def test_a_late_lock_is_waited_for_until_stale_or_beating(tmp_path):
    """A restarted job whose new rank 0 is on another host meets the lock of the rank 0
    that died moments ago: late (over 1.5 intervals) but not stale yet. It waits and takes
    it over once stale; a holder that beats again in the meantime keeps it."""
    root = str(tmp_path / "ckpt")
    _write_lock(root, 18378, host="node0", age=1.7, interval=1.0)   # stale after 3 s
    said = []
    started = time.monotonic()
    lock = SaveLock.acquire(root, log=said.append)
    waited = time.monotonic() - started
    assert 1.0 < waited < 3.0, waited
    assert "has had no heartbeat for 2s (interval 1s): waiting up to 1s more" in said[0], said
    assert "of host node0 pid 18378: its heartbeat is 3s old" in said[1], said
    lock.release()

    # the other ranks would time out in their collective first: no wait, exit 4 as before
    _write_lock(root, 18378, host="node0", age=1.7, interval=1.0)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"in use by another job \(host node0"):
        SaveLock.acquire(root, log=said.append, max_wait=0.5)
    assert time.monotonic() - started < 0.5

    path = _write_lock(root, 18378, host="node0", age=1.7, interval=1.0)

    def beat():
        time.sleep(0.5)
        info = json.load(open(path))
        info["heartbeat"] = time.time()
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)

    beating = threading.Thread(target=beat)
    beating.start()
    with pytest.raises(CheckpointError, match=r"in use by another job \(host node0"):
        SaveLock.acquire(root, log=said.append)
    beating.join()


def test_a_lock_taken_over_is_not_refreshed_or_removed_by_its_old_holder(tmp_path):
    root = str(tmp_path / "ckpt")
    lock = SaveLock.acquire(root, log=print)
    _write_lock(root, 1, host="elsewhere")
    with pytest.raises(CheckpointError, match="another job took over"):
        lock.refresh()
    lock.release()
    assert os.path.exists(os.path.join(root, LOCK))


def test_each_file_is_hashed_by_one_rank_that_reads_it(tmp_path):
    """The coordinator gives every manifest file to exactly one rank: a reader of it when
    there is one (replicas split the files between them instead of each hashing all),
    the largest files spread first; a file nobody reads goes to the least loaded rank."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from megalite.checkpoint.verify import VerifyingReader

    sizes = {"a.distcp": 400, "b.distcp": 300, "c.distcp": 200, "d.distcp": 100,
             "unread.bin": 50}
    manifest = {n: {"bytes": b, "xxh3_64": "0"} for n, b in sizes.items()}
    reader = VerifyingReader(str(tmp_path), manifest, 0, 3)

    def item(fqn, name, length):
        index = MetadataIndex(fqn, torch.Size([0]))
        reader.storage_data[index] = _StorageInfo(name, 0, length)
        return ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]),
                        torch.Size([1]))

    # ranks 0 and 1 are replicas reading a, b and c whole; rank 2 reads d and a sliver of a
    plans = [LoadPlan([item(f"{n}@{r}", n, sizes[n]) for n in ("a.distcp", "b.distcp",
                                                                "c.distcp")])
             for r in range(2)]
    plans.append(LoadPlan([item("d@2", "d.distcp", 100), item("a@2", "a.distcp", 10)]))
    mine = [p.storage_data["verify"] for p in reader.prepare_global_plan(plans)]
    assert mine == [["a.distcp"], ["b.distcp", "c.distcp"], ["d.distcp", "unread.bin"]]
    assert sorted(sum(mine, [])) == sorted(sizes)        # each file exactly once
