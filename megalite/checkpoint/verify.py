"""Checksums verified from the bytes DCP reads, as it reads them: :class:`VerifyingReader`.

A ``FileSystemReader`` that hashes each data file in order while DCP reads it, instead
of a second pass over the files: a tensor's bytes are read in pieces of :data:`PIECE`,
and each piece is hashed by a thread on another core while the next one is read (the
hashes release the GIL), from the CPU cache, so the hash never reads the file again. A
read hands its buffer back to DCP only once its pieces are hashed: it hashes the last
piece itself, and takes back the pieces the thread has not started (a busy machine may
not run it in time). The whole-file hash in a thread beside DCP's read, before, read
every byte again from memory, on the core where torch's second intra-op thread copies
(and spins between copies); tools/benchmark.py checkpoint: README.

How every byte of a file is hashed in order (the fast checksums are of whole files,
xxh3_64 or crc32, neither combinable from pieces):

* the plan's reads are sorted by file and offset (DCP reads them in state-dict order);
* a read larger than :data:`SMALL` (a tensor's bytes) first hashes, with ``pread``,
  what lies before it that is not hashed yet: blobs this rank does not read, the end of
  the previous blob, the zip headers and pickles ``torch.load`` read in small reads. A
  large read far ahead in its blob (a zip directory, read first) is left for later;
* when DCP closes the file, the rest is hashed the same way and the digest is compared
  with the manifest's.

A file this rank reads less than :data:`FUSED_COVERAGE` of (a weights-only load, some
reshardings) is hashed whole by a thread beside the read, and so is every file that no
rank reads (the coordinator hands those out in ``prepare_global_plan``): every rank
verifies the files it reads itself. ``.metadata`` is read before the plan exists; the
caller verifies it first.

Nothing is raised from inside DCP's read: :meth:`VerifyingReader.outcome` returns the
first damaged file (collect it on every rank, then agree). After a failed read it first
hashes whole the files this rank had not finished, so damage that broke ``torch.load``
is named rather than the unpickling error it caused.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import os
import threading
import zlib
from contextlib import contextmanager

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan

from megalite.checkpoint.files import CheckpointError, check_checksums, xxhash

PIECE = 1 << 20            # a tensor's bytes are read and hashed in pieces of this size
SMALL = 1 << 16            # smaller reads (zip records, pickles) are hashed by a pread
FUSED_COVERAGE = 0.75      # files this rank reads less of are hashed whole by a thread
METADATA_FILE = ".metadata"
PIPELINE = (os.cpu_count() or 1) > 1   # hash pieces on another core (else all inline)


def fast_algorithm(entry: dict) -> str | None:
    """The fast checksum recorded for a manifest entry (None: saved without one)."""
    return next((a for a in ("xxh3_64", "crc32") if a in entry), None)


def _pread(fd: int, into: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [into], offset)
    data = os.pread(fd, len(into), offset)
    into[:len(data)] = data
    return len(data)


class _Digest:
    """:func:`megalite.checkpoint.files.fast_checksum`, fed in order."""

    def __init__(self, algorithm: str, path: str):
        self.algorithm = algorithm
        if algorithm == "xxh3_64":
            if xxhash is None:
                raise CheckpointError(
                    f"checkpoint file {path} was checksummed with xxh3_64, which needs the "
                    "xxhash package (pip install xxhash); or load with --no-ckpt-verify")
            self.state = xxhash.xxh3_64()
        else:
            self.crc = 0

    def update(self, data) -> None:   # both release the GIL
        if self.algorithm == "xxh3_64":
            self.state.update(data)
        else:
            self.crc = zlib.crc32(data, self.crc)

    def hexdigest(self) -> str:
        if self.algorithm == "xxh3_64":
            return self.state.hexdigest()
        return f"{self.crc:08x}"


class _PieceHasher:
    """A thread that hashes the pieces handed to it, in order, on another core while
    the reading thread reads the next piece (the hashes release the GIL). The pieces
    view DCP's buffers: :meth:`take_back` before a buffer goes back to DCP."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.queue: collections.deque = collections.deque()
        self.busy = self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="checkpoint-verify-pieces",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if not self.queue:
                    return
                digest, data = self.queue.popleft()
                self.busy = True
            try:
                digest.update(data)
            except BaseException as exc:  # noqa: BLE001 - raised by take_back()
                self.error = exc
            data = None     # keeps no view of DCP's buffer
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def add(self, digest: _Digest, data: memoryview) -> None:
        with self.cond:
            self.queue.append((digest, data))
            self.cond.notify_all()

    def take_back(self) -> list:
        """The pieces not started yet (in order: the caller hashes them), once the one
        being hashed is done -- a busy machine may not run the thread in time."""
        with self.cond:
            rest = list(self.queue)
            self.queue.clear()
            while self.busy:
                self.cond.wait()
        if self.error is not None:
            raise self.error
        return rest

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()


class _HashingStream:
    """The file object DCP reads one data file through: passes every call on to
    ``stream`` and hashes the file in order as it is read (module docstring)."""

    def __init__(self, stream, path: str, size: int, algorithm: str, want: str,
                 blobs: list[int], later: _PieceHasher | None = None):
        self.stream, self.path, self.size, self.want = stream, path, size, want
        self.blobs, self.later = blobs, later     # offsets of the blobs DCP reads, sorted
        self.digest = _Digest(algorithm, path)
        self.done = 0           # bytes [0, done) are hashed
        self.scratch: memoryview | None = None
        # what torch.distributed.checkpoint's _ReaderView calls on its base stream
        # (small reads -- zip records, pickles -- are hashed by the next fill)
        self.seek, self.tell, self.read = stream.seek, stream.tell, stream.read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if len(buffer) <= SMALL:
            return self.stream.readinto(buffer)
        view = memoryview(buffer).cast("B")
        start = self.stream.tell()
        if start > self.done:
            i = bisect.bisect_right(self.blobs, start) - 1
            blob = self.blobs[i] if i >= 0 else 0
            if self.done < blob:
                self._fill(self.done, blob)     # before the blob read: DCP never reads it
            if start - self.done > SMALL:       # far ahead in its blob: hashed later
                return self.stream.readinto(view)
            self._fill(self.done, start)
        # a tensor's bytes: each piece is hashed right after it is read, by ``later`` (on
        # another core, while the next one is read) or here; all before DCP gets them
        total, later = 0, self.later
        try:
            while total < len(view):
                n = self.stream.readinto(view[total:total + PIECE])
                if not n:
                    break
                end = start + total + n
                if end > self.done:     # (a blob read twice is hashed once)
                    piece = view[total + max(0, self.done - start - total):total + n]
                    if later is not None and total + n < len(view):
                        later.add(self.digest, piece)
                    else:
                        self._take_back()
                        self.digest.update(piece)
                    self.done = end
                total += n
        finally:
            self._take_back()
        return total

    def _take_back(self) -> None:
        if self.later is not None:
            for digest, piece in self.later.take_back():
                digest.update(piece)

    def _fill(self, start: int, end: int) -> None:
        """Hash bytes [start, end), read with pread (the stream keeps its position)."""
        if self.scratch is None:
            self.scratch = memoryview(bytearray(PIECE))
        fd = self.stream.fileno()
        while start < end:
            n = _pread(fd, self.scratch[:min(PIECE, end - start)], start)
            if n <= 0:
                break           # shorter than the manifest says: the digest will differ
            self.digest.update(self.scratch[:n])
            start += n
        self.done = max(self.done, start)

    def finish(self) -> str | None:
        """Hash what DCP did not read; the damage found, or None."""
        self._fill(self.done, self.size)
        if self.digest.hexdigest() != self.want:
            return (f"checkpoint file {self.path} is damaged: its {self.digest.algorithm} "
                    "differs from the manifest's")
        return None


class _HashingFileSystem(FileSystem):
    """DCP's file system, handing out :class:`_HashingStream` for the files that
    ``reader`` verifies as it reads them."""

    def __init__(self, reader: VerifyingReader):
        super().__init__()
        self.reader = reader

    @contextmanager
    def create_stream(self, path, mode: str):
        name = os.path.basename(str(path))
        if mode != "rb" or name not in self.reader.fused:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        entry = self.reader.manifest[name]
        algorithm = fast_algorithm(entry)
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream, str(path), entry["bytes"], algorithm,
                                     entry[algorithm], self.reader.blobs[name],
                                     self.reader.pieces)
            yield hashing
            # only after a read that did not raise: a failed one is hashed whole later
            error = hashing.finish()
            self.reader.fused.discard(name)
            if error is not None:
                self.reader.errors.append(error)


class VerifyingReader(FileSystemReader):
    """DCP's ``FileSystemReader`` for ``iter_dir``, reading every file's blocks in file
    order; with a ``manifest`` it verifies the fast checksums of the data files this
    rank reads (and of those no rank reads, split over the ranks) as it reads them
    (module docstring). ``.metadata`` is the caller's to verify. Get the verdict from
    :meth:`outcome` once DCP's load returned or raised."""

    def __init__(self, iter_dir: str, manifest: dict | None, rank: int, world_size: int):
        super().__init__(iter_dir)
        self.iter_dir, self.rank, self.world_size = iter_dir, rank, world_size
        self.manifest = {n: e for n, e in (manifest or {}).items()
                         if n != METADATA_FILE and fast_algorithm(e) is not None}
        self.fs = _HashingFileSystem(self)
        self.fused: set[str] = set()     # hashed as read; removed once verified
        self.whole: list[str] | None = None   # hashed whole by the thread (None: unknown)
        self.errors: list[str] = []
        self.thread: threading.Thread | None = None
        self.pieces: _PieceHasher | None = None
        self.blobs: dict[str, list[int]] = {}   # fused file -> offsets of the blobs read

    def _reads(self, plan: LoadPlan) -> dict[str, dict[int, int]]:
        """``{file: {offset: length}}`` of the saved blobs ``plan`` reads (DCP reads
        each whole)."""
        out: dict[str, dict[int, int]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            out.setdefault(info.relative_path, {})[info.offset] = info.length
        return out

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) hand each file that no rank reads to one rank, the fewest bytes
        first, in the plans' ``storage_data``."""
        plans = super().prepare_global_plan(plans)
        if not self.manifest:
            return plans
        read = set()
        for plan in plans:
            read.update(self._reads(plan))
        load = [0] * len(plans)
        mine: list[list[str]] = [[] for _ in plans]
        for name in sorted(set(self.manifest) - read):
            rank = min(range(len(plans)), key=lambda r: (load[r], r))
            mine[rank].append(name)
            load[rank] += self.manifest[name]["bytes"]
        return [dataclasses.replace(plan, storage_data={"verify_whole": names})
                for plan, names in zip(plans, mine)]

    def read_data(self, plan: LoadPlan, planner):
        items = sorted(plan.items, key=lambda item: (
            self.storage_data[item.storage_index].relative_path,
            self.storage_data[item.storage_index].offset))
        plan = dataclasses.replace(plan, items=items)
        if self.manifest:
            whole = list((plan.storage_data or {}).get("verify_whole", []))
            for name, blobs in self._reads(plan).items():
                if name not in self.manifest:
                    continue
                if sum(blobs.values()) >= FUSED_COVERAGE * self.manifest[name]["bytes"]:
                    self.fused.add(name)
                    self.blobs[name] = sorted(blobs)
                else:
                    whole.append(name)
            self.whole = sorted(whole)
            if self.whole:
                self.thread = threading.Thread(target=self._hash_whole, args=(self.whole,),
                                               name="checkpoint-verify", daemon=True)
                self.thread.start()
        if not (self.fused and PIPELINE):
            return super().read_data(plan, planner)
        self.pieces = _PieceHasher()
        try:
            return super().read_data(plan, planner)
        finally:
            self.pieces.close()
            self.pieces = None

    def _hash_whole(self, names: list[str]) -> None:
        try:
            check_checksums(self.iter_dir, self.manifest, names, fast=True)
        except (CheckpointError, OSError) as exc:
            self.errors.append(str(exc))

    def outcome(self, failed: bool = False) -> str | None:
        """The first damaged file this rank found, or None. ``failed``: DCP's load
        raised; first hash whole what this rank had yet to verify (its share of the
        files when the read never started)."""
        if self.thread is not None:
            self.thread.join()
        if failed and self.manifest:
            rest = (sorted(self.fused) if self.whole is not None else
                    sorted(self.manifest)[self.rank::self.world_size])
            self.fused.clear()
            self._hash_whole(rest)
        return self.errors[0] if self.errors else None
