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
import mmap
import os
import re
import threading
import zlib

from megalite.errors import EXIT_CHECKPOINT, KnownError

try:  # xxh3 hashes ~4x faster than zlib's crc32; any file saved with it needs it to verify
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

METADATA = "metadata.json"
LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"iter_(\d{7})")


class CheckpointError(KnownError, RuntimeError):
    """A checkpoint that cannot be written, found, read, or does not fit the model."""

    exit_code = EXIT_CHECKPOINT


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> int | None:
    """The iteration named by ``latest_checkpointed_iteration.txt``, None without one; a
    pointer that holds anything but a number (bytes that are not text included) is a
    :class:`CheckpointError` naming what it holds and the newest complete checkpoint to
    load instead."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isascii() and text.isdigit():
        return int(text)
    if text == "release":
        what = ("'release', Megatron-LM's marker of a released checkpoint (a release/ "
                "directory), which megalite does not read")
    elif text == "":
        what = "nothing (it is empty)"
    elif text is None:
        what = f"bytes that are not text ({raw[:24]!r}{'...' if len(raw) > 24 else ''})"
    else:
        what = f"{text[:40]!r}{'...' if len(text) > 40 else ''}"
    raise CheckpointError(f"{path} should hold an iteration number, found {what}; "
                          f"{newest_complete_hint(root)}")


def fsync_path(path: str) -> None:
    """Flush a file's written data, or a directory's entries, to the disk (any read-only
    descriptor of it will do)."""
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
    fsync_path(os.path.dirname(path) or ".")


def fsync_tree(path: str) -> None:
    """fsync every directory under ``path`` (files are fsynced by their writers)."""
    for d, _, _ in os.walk(path):
        fsync_path(d)


# -- manifest ------------------------------------------------------------------------------
FAST_ALGORITHMS = ("xxh3_64", "crc32")   # the fast checksums a manifest entry may record
FAST_CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"
_HASH_CHUNK = 8 << 20      # bytes hashed per call (each releases the GIL)


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fast_checksum(path: str, algorithm: str = FAST_CHECKSUM) -> str:
    """The file's xxh3_64 or crc32 as hex, hashed from a read-only map of it read
    sequentially (no copy, the kernel reads ahead; both hashes release the GIL, so a
    thread can hash while another reads the same pages)."""
    if algorithm == "xxh3_64" and xxhash is None:
        raise CheckpointError(
            f"checkpoint file {path} was checksummed with xxh3_64, which needs the xxhash "
            "package (pip install xxhash); or load with --no-ckpt-verify")
    state = xxhash.xxh3_64() if algorithm == "xxh3_64" else None
    crc = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        try:
            if data is not None and hasattr(data, "madvise"):
                data.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(data if data is not None else b"") as view:
                for start in range(0, size, _HASH_CHUNK):
                    chunk = view[start:start + _HASH_CHUNK]
                    if state is not None:
                        state.update(chunk)
                    else:
                        crc = zlib.crc32(chunk, crc)
                    chunk.release()
        finally:
            if data is not None:
                data.close()
    return state.hexdigest() if state is not None else f"{crc:08x}"


def manifest_entries(root: str, names: list[str], fast: bool = True,
                     sha256: bool = False, fsync: bool = False) -> dict[str, dict]:
    """``{name: {"bytes": size[, FAST_CHECKSUM: hex][, "sha256": hex]}}`` for ``names``.

    ``fsync``: also fsync every file (a save writes them unsynced), while a thread hashes
    them from the page cache: the checksums are computed while the disk writes, instead
    of after it (the hashes and fsync release the GIL)."""
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def entries() -> None:
        try:
            for name in names:
                path = os.path.join(root, name)
                entry = {"bytes": os.path.getsize(path)}
                if fast:
                    entry[FAST_CHECKSUM] = fast_checksum(path)
                if sha256:
                    entry["sha256"] = sha256_file(path)
                out[name] = entry
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    if not fsync:
        entries()
    else:
        hasher = threading.Thread(target=entries, name="checkpoint-checksums", daemon=True)
        hasher.start()
        try:
            for name in names:
                fsync_path(os.path.join(root, name))
        finally:
            hasher.join()
    if errors:
        raise errors[0]
    return out


def read_metadata(iter_dir: str) -> dict:
    """``metadata.json`` of an iteration directory; a clear error for anything else."""
    return parse_metadata(iter_dir, read_metadata_bytes(iter_dir))


def read_metadata_bytes(iter_dir: str) -> bytes:
    """The raw ``metadata.json`` (its sha256 identifies a checkpoint across ranks)."""
    path = os.path.join(iter_dir, METADATA)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"checkpoint directory {iter_dir} does not exist")
    if not os.path.exists(path):
        entries = sorted(os.listdir(iter_dir))
        hint = ""
        if any(e.startswith("mp_rank_") for e in entries):
            hint = (" It holds mp_rank_* directories: a Megatron-LM checkpoint of the "
                    f"per-rank format; {_CONVERT_HINT}.")
        raise CheckpointError(f"{path} is missing: {iter_dir} is not a megalite checkpoint "
                              f"(or was damaged).{hint} Found: {entries[:8]}")
    with open(path, "rb") as f:
        return f.read()


_CONVERT_HINT = ("convert it first: tools/convert_checkpoint.py --source megatron --target "
                 "megalite --load-dir MEGATRON_DIR --save-dir NEW_DIR (it carries the "
                 "optimizer state and prints the flags that resume the run)")


def parse_metadata(iter_dir: str, raw: bytes) -> dict:
    path = os.path.join(iter_dir, METADATA)
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path} is damaged: {exc}") from None
    from megalite.checkpoint.state import FORMAT

    if "sharded_backend" in meta:   # Megatron-Core's distributed checkpoint
        raise CheckpointError(f"{iter_dir} is a Megatron-LM checkpoint ({meta['sharded_backend']}"
                              f" format), not a megalite one; {_CONVERT_HINT}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; this version "
                              f"reads {FORMAT!r}")
    return meta


def check_sizes(iter_dir: str, manifest: dict, names: list[str]) -> None:
    """Each of ``names`` exists with its manifest size."""
    for name in names:
        want = manifest[name]
        path = os.path.join(iter_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint file {path} is damaged: {size} bytes, the "
                                  f"manifest says {want['bytes']} (truncated?)")


def check_checksums(iter_dir: str, manifest: dict, names: list[str], *, fast: bool = True,
                    sha256: bool = False) -> None:
    """``fast``: the xxh3_64 / crc32 recorded at save (files saved before megalite recorded
    one are skipped); ``sha256``: the sha256 recorded under ``--ckpt-verify`` (required)."""
    for name in names:
        want = manifest[name]
        path = os.path.join(iter_dir, name)
        if fast:
            for algorithm in FAST_ALGORITHMS:
                if algorithm in want and fast_checksum(path, algorithm) != want[algorithm]:
                    raise CheckpointError(f"checkpoint file {path} is damaged: its "
                                          f"{algorithm} differs from the manifest's")
        if sha256 and "sha256" not in want:
            raise CheckpointError(f"checkpoint file {path} has no sha256 in the manifest "
                                  "(saved without --ckpt-verify); load without "
                                  "--ckpt-verify (the default checksum is still checked)")
        if sha256 and sha256_file(path) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is damaged: its sha256 differs "
                                  "from the manifest's")


def published_iterations(root: str) -> list[int]:
    """Iterations of the ``iter_*`` directories under ``root`` (published saves), sorted."""
    entries = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for e in entries if (m := ITER_RE.fullmatch(e)))


def complete_iterations(root: str, below: int | None = None) -> list[int]:
    """Published iterations (below ``below``) whose metadata reads and whose every file has
    its manifest size, newest first: what a damaged checkpoint can fall back to (their
    checksums are checked when they are loaded)."""
    out = []
    for it in reversed(published_iterations(root)):
        if below is not None and it >= below:
            continue
        d = iteration_dir(root, it)
        try:
            manifest = read_metadata(d)["files"]
            check_sizes(d, manifest, sorted(manifest))
        except (CheckpointError, OSError, KeyError):
            continue
        out.append(it)
    return out


def fallback_hint(root: str, iteration: int) -> str:
    """One sentence naming the older complete checkpoint to load instead."""
    older = complete_iterations(root, below=iteration)
    if not older:
        return f"no older complete checkpoint exists under {root}"
    return (f"the newest older complete checkpoint is iteration {older[0]}{_also(older)}: "
            f"load it with --ckpt-step {older[0]}")


def newest_complete_hint(root: str, exclude: int | None = None) -> str:
    """One sentence naming the newest complete checkpoint under ``root`` (other than
    ``exclude``) to load with ``--ckpt-step``, or saying that there is none."""
    good = [it for it in complete_iterations(root) if it != exclude]
    if not good:
        return f"no complete checkpoint exists under {root}"
    return (f"the newest complete checkpoint there is iteration {good[0]}{_also(good)}: "
            f"load it with --ckpt-step {good[0]}")


def _also(iterations: list[int]) -> str:
    return f" (also: {', '.join(map(str, iterations[1:6]))})" if len(iterations) > 1 else ""


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


def choose_iteration(root: str, step: int | None, *, save_dir: str | None = None,
                     finetune: bool = False) -> int | None:
    """``step`` (``--ckpt-step``) when ``root`` holds it -- else an error listing the
    iterations it does hold -- or :func:`find_iteration`'s choice without one."""
    if step is None:
        return find_iteration(root, save_dir=save_dir, finetune=finetune)
    if not os.path.isdir(iteration_dir(root, step)):
        held = published_iterations(root)
        what = (f"available: {', '.join(map(str, held))}" if held else
                "it holds no published iteration")
        raise CheckpointError(f"--ckpt-step {step}: {root} has no iteration {step} "
                              f"({iteration_dir(root, step)} does not exist); {what}")
    return step
