"""Writing checkpoints: :func:`save_checkpoint` and :class:`CheckpointSaver` (async).

A save, collective over the world:

1. rank 0 (re)creates ``iter_XXXXXXX.tmp``;
2. every rank builds its flat state dict (:mod:`megalite.checkpoint.state`) and DCP
   writes the blocks (``torch.distributed.checkpoint.save`` with
   :class:`~megalite.checkpoint.planner.BlockSavePlanner`); each rank lists the sizes and
   fast checksums (xxh3_64 with the xxhash package, else zlib's crc32; plus sha256 with
   ``verify``, ``--ckpt-verify``) of the files it wrote;
3. *publish*: when every rank succeeded, rank 0 writes ``metadata.json`` (format,
   iteration, layout, config, manifest), renames the directory to ``iter_XXXXXXX`` and
   replaces ``latest_checkpointed_iteration.txt``. A failure anywhere raises one
   :class:`CheckpointError` on every rank, after rank 0 removed the partial
   ``iter_XXXXXXX.tmp``; the previous checkpoint stays latest, and the error says which
   it is. A full disk is named as such, with the free space and the size of the
   checkpoint (what it needs), whatever form the failure took (an ``OSError`` ENOSPC,
   or torch's zip writer failing with ``unexpected pos``).

With ``async_save`` step 2 runs on a copy of the state (staged: copied to CPU buffers the
saver keeps for the next save, one extra copy of the state in host memory) in a
background thread, over a dedicated gloo process group, while training continues; step 3
runs at the next save or at :meth:`CheckpointSaver.finalize` / :meth:`close` (end of
training), so ``latest`` only ever names a checkpoint every rank finished writing.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.files import (
    FAST_CHECKSUM,
    LATEST,
    METADATA,
    CheckpointError,
    fsync_path,
    fsync_tree,
    iteration_dir,
    manifest_entries,
    read_latest_iteration,
    read_metadata,
    write_text_atomic,
)
from megalite.checkpoint.layout import param_layouts
from megalite.checkpoint.planner import save_blocks
from megalite.checkpoint.rng import capture_rng_state
from megalite.checkpoint.state import FORMAT, add_fp8_histories, save_state
from megalite.parallel import collectives
from megalite.parallel.state import ParallelState


def layout_of(ps: ParallelState) -> dict:
    """The parallel layout recorded in a checkpoint (RNG states restore only on equal)."""
    return {"tp": ps.tp.size, "pp": ps.pp.size, "dp": ps.dp.size, "cp": ps.cp.size,
            "ep": ps.ep.size, "etp": ps.etp.size, "vpp": ps.vpp_size,
            "world_size": ps.world_size}


def distributed(ps: ParallelState) -> bool:
    return ps.world_size > 1 and collectives.is_initialized()


def gather_objects(obj, ps: ParallelState) -> list:
    """Every rank's ``obj`` (all-gather over the world; a list of one without one)."""
    if not distributed(ps):
        return [obj]
    return collectives.all_gather_object(obj)


def raise_if_any(error: str | None, ps: ParallelState, template: str) -> None:
    """Raise ``CheckpointError(template.format(error=...))`` on every rank if any rank
    passes an error (collective); the first failing rank's message is reported."""
    errors = gather_objects(error, ps)
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if first is not None:
        where = "" if first[0] == ps.rank else f"on rank {first[0]}: "
        raise CheckpointError(template.format(error=f"{where}{first[1]}"))


def write_blocks(state: dict, pieces: dict, directory: str, group, no_dist: bool) -> None:
    """DCP-write this rank's blocks into ``directory``, unsynced: :meth:`_Job.write`
    fsyncs them while it checksums them (tests patch this to inject crashes)."""
    save_blocks(state, pieces, directory, group=group, no_dist=no_dist, sync_files=False)


def _my_files(directory: str, rank: int) -> list[str]:
    """Files of ``directory`` that DCP rank ``rank`` wrote (rank 0 also owns .metadata)."""
    mine = [f for f in os.listdir(directory) if f.startswith(f"__{rank}_")]
    if rank == 0:
        mine.append(".metadata")
    return sorted(mine)


def _state_bytes(state: dict) -> int:
    """Bytes of the tensors in a flat state dict: what this rank writes, about."""
    return sum(v.numel() * v.element_size() for v in state.values()
               if isinstance(v, torch.Tensor))


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, the exceptions it was raised from, and those a DCP
    ``CheckpointException`` carries per rank."""
    out, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
    return out


def _describe(exc: BaseException) -> str:
    """One line for a failed write: the first rank's own exception for DCP's
    ``CheckpointException`` (whose text is every rank's traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def out_of_space(exc: BaseException, directory: str, need: int) -> bool:
    """Whether a write into ``directory`` failed because its disk is full: ENOSPC
    anywhere in the exception, or less free space left there than ``need`` bytes
    (torch's zip writer reports a short write as ``unexpected pos``, without errno)."""
    if any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(exc)):
        return True
    try:
        return shutil.disk_usage(directory).free < need
    except OSError:
        return False


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.0f} KiB"


@dataclass
class _Job:
    """One save between its start and its publication. ``nbytes``: the tensor bytes
    this rank writes; ``no_space``: its write failed on a full disk."""

    root: str
    iteration: int
    tmp: str
    final: str
    meta: dict
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    thread: threading.Thread | None = None
    files: dict | None = None
    error: str | None = None
    no_space: bool = False

    def write(self, state: dict, pieces: dict, group, no_dist: bool, rank: int,
              sha256: bool, fast: bool = True) -> None:
        try:
            write_blocks(state, pieces, self.tmp, group, no_dist)
            self.files = manifest_entries(self.tmp, _my_files(self.tmp, rank), fast=fast,
                                          sha256=sha256, fsync=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported
            self.error = _describe(exc)                   # collectively at publication
            self.no_space = out_of_space(exc, self.tmp, self.nbytes)


class CheckpointSaver:
    """Saves checkpoints, synchronously or (``async_save``) in a background thread.

    Create it on every rank (collective when async: it makes a gloo process group for the
    background collectives), call :meth:`save` for each checkpoint and :meth:`close` at
    the end. The manifest holds each file's fast checksum; ``verify``
    (``--ckpt-verify``): sha256 as well. ``checksums=False`` leaves the fast checksum out
    (``tools/benchmark.py checkpoint`` measures its cost so; such a checkpoint loads
    unverified).
    """

    def __init__(self, ps: ParallelState, *, async_save: bool = False, verify: bool = False,
                 checksums: bool = True):
        self.ps = ps
        self.async_save = async_save
        self.verify = verify
        self.checksums = checksums
        self.pending: _Job | None = None
        self.staging: dict[str, torch.Tensor] = {}   # async: CPU buffers reused per save
        self.group = None
        if async_save and distributed(ps):
            self.group = collectives.new_world_group(backend="gloo")

    def save(self, root: str, iteration: int, model, optimizer, scheduler, config: dict,
             consumed_samples: int, *, save_optim: bool = True, save_rng: bool = True,
             rng_tracker=None, extra_meta: dict | None = None) -> str:
        """Write (or, async, start writing) the checkpoint of ``iteration`` under
        ``root``; returns the directory it is published as. Collective. ``extra_meta``
        (rank 0's are written): more keys for ``metadata.json``, e.g. the wandb run id."""
        self.finalize()
        ps = self.ps
        final = iteration_dir(root, iteration)
        tmp = final + ".tmp"
        error = None
        if ps.rank == 0:
            try:
                os.makedirs(root, exist_ok=True)
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
            except OSError as exc:
                error = repr(exc)
        raise_if_any(error, ps, f"cannot create {tmp} ({{error}})")

        layouts = param_layouts(model, ps)
        common = {"format": FORMAT, "iteration": iteration,
                  "consumed_samples": consumed_samples,
                  "scheduler": scheduler.state_dict() if scheduler is not None else None,
                  "loss_scaler": (optimizer.scaler.state_dict()
                                  if save_optim and optimizer is not None else None)}
        rng = capture_rng_state(rng_tracker, ps.device) if save_rng else None
        state, pieces, names = save_state(layouts, optimizer if save_optim else None,
                                          common, rng, ps.rank)
        add_fp8_histories(state, pieces, model)
        meta = {"format": FORMAT, "iteration": iteration,
                "consumed_samples": consumed_samples, "layout": layout_of(ps),
                "optimizer_state": names if save_optim and optimizer is not None else None,
                "rng": save_rng,
                "checksums": ([FAST_CHECKSUM] if self.checksums else [])
                + (["sha256"] if self.verify else []),
                "config": config, **(extra_meta or {})}
        job = _Job(root, iteration, tmp, final, meta, nbytes=_state_bytes(state))
        no_dist = not distributed(ps)
        if self.async_save:
            staged = self._stage(state)
            job.thread = threading.Thread(
                target=job.write, name=f"checkpoint-{iteration}", daemon=True,
                args=(staged, pieces, self.group, no_dist, ps.rank, self.verify,
                      self.checksums))
            job.thread.start()
            self.pending = job
        else:
            job.write(state, pieces, None, no_dist, ps.rank, self.verify, self.checksums)
            self._publish(job)
        return final

    def _stage(self, state: dict) -> dict:
        """A private CPU copy of ``state`` that training cannot modify while it is written.
        The buffers are kept and refilled by the next save (the previous write has
        finished by then), so later saves skip the allocation and its page faults."""
        out = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                out[key] = copy.deepcopy(value)
                continue
            buf = self.staging.get(key)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = self.staging[key] = torch.empty(value.shape, dtype=value.dtype,
                                                      pin_memory=value.is_cuda)
            out[key] = buf.copy_(value.detach())
        return out

    def finalize(self) -> str | None:
        """Wait for a pending async save and publish it (collective); its directory, or
        None when nothing was pending."""
        job, self.pending = self.pending, None
        if job is None:
            return None
        job.thread.join()
        self._publish(job)
        if self.ps.rank == 0:
            print(f" async checkpoint of iteration {job.iteration} published to {job.final} "
                  f"({time.perf_counter() - job.started:.2f}s after it started)", flush=True)
        return job.final

    def close(self) -> None:
        """Finalize and release the background process group."""
        try:
            self.finalize()
        finally:
            self.staging.clear()
            if self.group is not None:
                collectives.destroy_group(self.group)
                self.group = None

    def _publish(self, job: _Job) -> None:
        ps = self.ps
        outcomes = gather_objects((job.error, job.no_space, job.nbytes), ps)
        self._raise_if_failed(job, [(e, full) for e, full, _ in outcomes],
                              sum(n for _, _, n in outcomes))
        manifests = gather_objects(job.files, ps)
        outcome = (None, False)
        if ps.rank == 0:
            try:
                files = {}
                for entries in manifests:
                    files.update(entries)
                _publish_dir(job, files)
            except OSError as exc:
                need = sum(n for _, _, n in outcomes)
                outcome = (f"publishing {job.final}: {_describe(exc)}",
                           out_of_space(exc, job.root, need))
        self._raise_if_failed(job, gather_objects(outcome, ps),
                              sum(n for _, _, n in outcomes))

    def _raise_if_failed(self, job: _Job, outcomes: list[tuple], need: int) -> None:
        """Collective: when a rank's ``(error, out of space)`` outcome is an error, rank 0
        removes the partial directory and every rank raises one :class:`CheckpointError`
        saying what happened (a full disk: the free space and what a checkpoint needs, the
        size of the previous one, else ``need``, the bytes of the state) and which
        checkpoint is still the latest."""
        first = next(((r, e) for r, (e, _) in enumerate(outcomes) if e is not None), None)
        if first is None:
            return
        no_space = any(full for _, full in outcomes)
        facts = None
        if self.ps.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
            try:
                previous = read_latest_iteration(job.root)
            except CheckpointError:
                previous = None
            try:
                free = shutil.disk_usage(job.root).free
            except OSError:
                free = None
            if previous is not None:
                try:
                    files = read_metadata(iteration_dir(job.root, previous))["files"]
                    need = sum(entry["bytes"] for entry in files.values())
                except (CheckpointError, OSError, KeyError, TypeError):
                    pass
            facts = (previous, free, need)
        previous, free, need = gather_objects(facts, self.ps)[0]
        where = "" if first[0] == self.ps.rank else f"on rank {first[0]}: "
        if no_space:
            room = "" if free is None else f"{_size(free)} free there, "
            cause = (f": no space left on device ({room}a checkpoint needs about "
                     f"{_size(need)})")
        else:
            cause = f" ({where}{first[1]})"
        kept = (f"the previous checkpoint, iteration {previous}, is intact ({LATEST} still "
                "names it)" if previous is not None else "no earlier checkpoint exists there")
        fix = "; free space there or choose another --save" if no_space else ""
        raise CheckpointError(f"saving iteration {job.iteration} to {job.root} failed"
                              f"{cause}; the partial {os.path.basename(job.tmp)} was "
                              f"removed; {kept}{fix}")


def _publish_dir(job: _Job, files: dict) -> None:
    """Rank 0, once every rank wrote: metadata.json, rename, then the latest pointer."""
    on_disk = set(os.listdir(job.tmp))
    missing = sorted(set(files) - on_disk)
    if missing:
        raise OSError(f"files reported written but absent from {job.tmp}: {missing}")
    meta = dict(job.meta, files=files, time=time.time())
    write_text_atomic(os.path.join(job.tmp, METADATA), json.dumps(meta, indent=1))
    fsync_tree(job.tmp)
    if os.path.exists(job.final):  # re-saving an iteration (e.g. after a resume)
        old = f"{job.final}.old{os.getpid()}"
        os.rename(job.final, old)
        os.rename(job.tmp, job.final)
        shutil.rmtree(old)
    else:
        os.rename(job.tmp, job.final)
    fsync_path(job.root)
    write_text_atomic(os.path.join(job.root, LATEST), f"{job.iteration}\n")


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler,
                    ps: ParallelState, config: dict, consumed_samples: int, *,
                    save_optim: bool = True, save_rng: bool = True, rng_tracker=None,
                    verify: bool = False, saver: CheckpointSaver | None = None,
                    extra_meta: dict | None = None) -> str:
    """Checkpoint ``iteration`` under ``root`` (collective over the world).

    ``model`` is a module or a list of pipeline chunks; ``optimizer`` a
    :class:`megalite.optim.optimizer.MixedPrecisionOptimizer` (or any optimizer with
    ``state_dict_per_param``) whose loss scaler is saved with it; ``scheduler`` an
    :class:`megalite.optim.lr_schedule.LRScheduler`; ``config`` the run's
    ``MegaliteConfig.to_dict()``. ``saver``: a :class:`CheckpointSaver` (async saves go
    through one); without it the save is synchronous. ``extra_meta``: more keys for
    ``metadata.json``. Returns the iteration directory. Raises :class:`CheckpointError`
    on every rank if any rank failed.
    """
    if saver is None:
        saver = CheckpointSaver(ps, verify=verify)
    return saver.save(root, iteration, model, optimizer, scheduler, config, consumed_samples,
                      save_optim=save_optim, save_rng=save_rng, rng_tracker=rng_tracker,
                      extra_meta=extra_meta)
