"""Checkpoint directories on disk: paths, the ``latest`` pointer, atomic writes, the
manifest of files (sizes and checksums) and its verification, and what ``--load DIR``
means when DIR holds no checkpoint.

::

    SAVE/
      latest_checkpointed_iteration.txt     "10" -- replaced atomically, last
      iter_0000010/
        metadata.json                       format, iteration, layout, config, manifest
        .metadata                           DCP: every global tensor, its chunks, where
        __0_0.distcp  __1_0.distcp ...      DCP: the blocks each rank wrote
      iter_0000012.tmp/                     a save in progress (or one that crashed)
"""

from __future__ import annotations

import hashlib
import json
import os
import re

METADATA = "metadata.json"
LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"iter_(\d{7})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found, read, or does not fit the model."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``, None without one."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") \
            from None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to a temporary file, fsync it, then ``os.replace`` it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_tree(path: str) -> None:
    """fsync every directory under ``path`` (files are fsynced by their writers)."""
    for d, _, _ in os.walk(path):
        fsync_dir(d)


# -- manifest ------------------------------------------------------------------------------
def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_entries(root: str, names: list[str], checksums: bool) -> dict[str, dict]:
    """``{name: {"bytes": size[, "sha256": hex]}}`` for files ``names`` under ``root``."""
    out = {}
    for name in names:
        path = os.path.join(root, name)
        entry = {"bytes": os.path.getsize(path)}
        if checksums:
            entry["sha256"] = sha256_file(path)
        out[name] = entry
    return out


def read_metadata(iter_dir: str) -> dict:
    """``metadata.json`` of an iteration directory; a clear error for anything else."""
    path = os.path.join(iter_dir, METADATA)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"checkpoint directory {iter_dir} does not exist")
    if not os.path.exists(path):
        entries = sorted(os.listdir(iter_dir))
        hint = ""
        if any(e.startswith("mp_rank_") for e in entries):
            hint = (" It holds mp_rank_* directories: a checkpoint of the older per-rank "
                    "format, which this version does not read.")
        raise CheckpointError(f"{path} is missing: {iter_dir} is not a megalite checkpoint "
                              f"(or was damaged).{hint} Found: {entries[:8]}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{path} is damaged: {exc}") from None
    from megalite.checkpoint.state import FORMAT

    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this version "
                              f"reads {FORMAT!r}")
    return meta


def verify_files(iter_dir: str, manifest: dict, names: list[str], checksums: bool) -> None:
    """Check that each of ``names`` exists with its manifest size (and checksum)."""
    for name in names:
        want = manifest[name]
        path = os.path.join(iter_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint file {path} is damaged: {size} bytes, the "
                                  f"manifest says {want['bytes']} (truncated?)")
        if checksums and "sha256" in want and sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is damaged: its sha256 differs "
                                  "from the manifest's")
        if checksums and "sha256" not in want:
            raise CheckpointError(f"checkpoint file {path} has no checksum in the manifest "
                                  "(saved without --ckpt-verify); load without "
                                  "--ckpt-verify")


# -- what --load means ----------------------------------------------------------------------
def _same_dir(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def find_iteration(root: str, *, save_dir: str | None = None,
                   finetune: bool = False) -> int | None:
    """The iteration ``--load root`` should restore, or None to start from scratch.

    * ``latest_checkpointed_iteration.txt`` names it.
    * No pointer and no ``iter_*`` directories (missing or empty directory, or only
      unpublished ``.tmp`` saves): start from scratch *only* when ``--save`` is the same
      directory and not ``--finetune`` -- the resume-or-start idiom of a launcher that
      passes ``--load D --save D`` every time. Anything else clearly expected weights
      (``--load`` without ``--save``, another ``--save``, ``--finetune``) and fails.
    * ``iter_*`` directories but no pointer: fails (a half-published save, or a pointer
      removed by hand); the message names them.
    """
    iteration = read_latest_iteration(root)
    if iteration is not None:
        return iteration
    entries = sorted(os.listdir(root)) if os.path.isdir(root) else []
    published = [e for e in entries if ITER_RE.fullmatch(e)]
    if published:
        raise CheckpointError(
            f"--load {root}: {published[-1]} (of {len(published)} iteration directories) "
            f"but no {LATEST}; if that checkpoint is complete, write its iteration number "
            f"into {os.path.join(root, LATEST)}")
    if _same_dir(root, save_dir) and not finetune:
        return None
    what = "does not exist" if not os.path.exists(root) else "holds no checkpoint"
    if "config.json" in entries:
        what += (" (it looks like a Hugging Face model: convert it with "
                 "tools/convert_checkpoint.py --source hf --target megalite)")
    why = ("--finetune needs weights" if finetune else
           "--load without --save pointing at the same directory expects a checkpoint")
    raise CheckpointError(f"--load {root}: the directory {what}, and {why}. To start from "
                          f"scratch drop --load, or pass --save {root} as well")
