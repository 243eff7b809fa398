"""Checksums verified beside DCP's read: :class:`VerifyingReader`.

A ``FileSystemReader`` that, once DCP has planned the load, starts a thread hashing
whole (:func:`megalite.checkpoint.files.fast_checksum`: a read-only map of the file,
walked in order, no copy) the data files given to this rank, while DCP reads on the
calling thread, sorted by file and offset. Where the rank also reads the file, both walk
the same pages in the same order, so it comes from the disk once and the hash mostly
finds its bytes still in the CPU cache; the hash (xxh3_64 at ~14 GB/s from memory, or
crc32) releases the GIL and runs on another core. ``tools/benchmark.py checkpoint``
measures it against a load without checksums (docs/benchmarks.md): about 2% from the page cache.
DCP's own order (state-dict order, jumping around the file) made the same thread cost
18%, and hashing the bytes DCP reads as pieces of its buffers (the design before this
one) 5-8%.

Each file is hashed by one rank: one that reads most of it, the least loaded of those (a
file no rank reads: the least loaded rank), so replicas (dp) and resharded reads do not
hash a file once per reader; the ranks agree on the outcome, so damage any rank finds
fails the load on all.

``.metadata`` is read before the plan exists: the caller verifies it first. Nothing is
raised from inside DCP's read: :meth:`VerifyingReader.outcome` returns the first damaged
file once the thread is done (collect it on every rank, then agree). The thread hashes
its files even when the read fails, so damage that broke ``torch.load`` is named rather
than the unpickling error it caused.
"""

from __future__ import annotations

import dataclasses
import threading

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan

from megalite.checkpoint.files import FAST_ALGORITHMS, CheckpointError, check_checksums

METADATA_FILE = ".metadata"


class VerifyingReader(FileSystemReader):
    """DCP's ``FileSystemReader`` for ``iter_dir``; with a ``manifest`` (metadata.json's
    ``files``) it verifies the fast checksums of the data files the coordinator gives
    this rank, in a thread beside the read (module docstring).
    ``.metadata`` is the caller's to verify. Get the verdict from :meth:`outcome` once
    DCP's load returned or raised."""

    def __init__(self, iter_dir: str, manifest: dict | None, rank: int, world_size: int):
        super().__init__(iter_dir)
        self.iter_dir, self.rank, self.world_size = iter_dir, rank, world_size
        self.manifest = {n: e for n, e in (manifest or {}).items()
                         if n != METADATA_FILE and any(a in e for a in FAST_ALGORITHMS)}
        self.mine: list[str] | None = None   # the files this rank hashes (None: unplanned)
        self.errors: list[str] = []
        self.thread: threading.Thread | None = None

    def _read(self, plan: LoadPlan) -> dict[str, int]:
        """``{file: bytes}`` that ``plan`` reads (DCP reads each saved blob whole)."""
        out: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            out[info.relative_path] = out.get(info.relative_path, 0) + info.length
        return out

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) give each manifest file to one rank to hash, in the plans'
        ``storage_data``: the largest files first, each to the least loaded of the ranks
        that read the most of it (within half of the most; any rank when none reads
        it)."""
        plans = super().prepare_global_plan(plans)
        if not self.manifest:
            return plans
        reads = [self._read(plan) for plan in plans]
        load = [0] * len(plans)
        share: list[list[str]] = [[] for _ in plans]
        for name in sorted(self.manifest, key=lambda n: (-self.manifest[n]["bytes"], n)):
            most = max(r.get(name, 0) for r in reads)
            ranks = [k for k, r in enumerate(reads) if r.get(name, 0) * 2 >= most > 0] \
                or range(len(plans))
            rank = min(ranks, key=lambda k: (load[k], k))
            share[rank].append(name)
            load[rank] += self.manifest[name]["bytes"]
        return [dataclasses.replace(plan, storage_data={"verify": sorted(names)})
                for plan, names in zip(plans, share)]

    def read_data(self, plan: LoadPlan, planner):
        """DCP's read of ``plan``, its items sorted by file and offset (DCP reads them in
        state-dict order): read in file order, the bytes are still cached when the
        thread hashing the same file in order reaches them."""
        plan = dataclasses.replace(plan, items=sorted(plan.items, key=lambda item: (
            self.storage_data[item.storage_index].relative_path,
            self.storage_data[item.storage_index].offset)))
        if self.manifest:
            self.mine = list((plan.storage_data or {}).get("verify", []))
            if self.mine:
                self.thread = threading.Thread(target=self._hash, args=(self.mine,),
                                               name="checkpoint-verify", daemon=True)
                self.thread.start()
        return super().read_data(plan, planner)

    def _hash(self, names: list[str]) -> None:
        try:
            check_checksums(self.iter_dir, self.manifest, names, fast=True)
        except CheckpointError as exc:
            self.errors.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a check that could not run is no pass
            self.errors.append(f"checkpoint files in {self.iter_dir} could not be verified: "
                               f"{type(exc).__name__}: {exc}")

    def outcome(self, failed: bool = False) -> str | None:
        """The first damaged file this rank found, or None. ``failed``: DCP's load
        raised; when it raised before the read was planned, hash this rank's share of
        all the files (by name) first."""
        if self.thread is not None:
            self.thread.join()
        if failed and self.manifest and self.mine is None:
            self._hash(sorted(self.manifest)[self.rank::self.world_size])
        return self.errors[0] if self.errors else None
