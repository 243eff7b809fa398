"""Loading checkpoints under any layout: :func:`load_checkpoint`.

Every rank reads only the overlap of its own blocks with the saved ones (DCP resharding),
so a checkpoint saved at (tp2, pp2, dp2) loads at (tp1, pp1, dp1) or (tp4, pp1, dp2).
Model weights are read straight into the parameters; optimizer state into fresh tensors
handed to the optimizer. RNG states are per rank and cannot be resharded: they are
restored only when the layout is unchanged, otherwise every generator is re-seeded from
(seed, iteration) and the log says so.

Rank 0 alone decides what to load (the ``latest`` pointer or ``--ckpt-step``) and
broadcasts the iteration with the sha256 of its ``metadata.json``; every rank checks that
it sees that same checkpoint, so a directory rewritten under a running load (another job)
is one error, never ranks restoring different iterations. All checks (files, manifest,
names and shapes) agree across ranks before any rank starts reading, so a bad checkpoint is
one :class:`CheckpointError` everywhere, not a hang. The files' checksums (xxh3_64 or
crc32, recorded at every save) are verified by default in a thread while DCP reads
(files split over ranks); a damaged file is named with the older complete iteration to
fall back to.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import TensorStorageMetadata

from megalite.checkpoint.files import (
    CheckpointError,
    check_checksums,
    check_sizes,
    choose_iteration,
    fallback_hint,
    iteration_dir,
    parse_metadata,
    read_metadata_bytes,
)
from megalite.checkpoint.layout import param_layouts, piece_keys, saved_global_shape
from megalite.checkpoint.planner import load_blocks
from megalite.checkpoint.rng import restore_rng_state
from megalite.checkpoint.save import distributed, gather_objects, layout_of, raise_if_any
from megalite.checkpoint.state import (
    COMMON,
    model_load_state,
    optimizer_load_state,
    rng_key,
)
from megalite.parallel import collectives
from megalite.parallel.state import ParallelState


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored."""

    iteration: int
    consumed_samples: int
    path: str
    layout_changed: bool = False
    rng_restored: bool = False


def resolve_checkpoint(root: str, ps: ParallelState, *, step: int | None = None,
                       save_dir: str | None = None, finetune: bool = False
                       ) -> tuple[int | None, str | None]:
    """(iteration, sha256 of its metadata.json) as rank 0 resolves them -- the latest
    pointer or ``step`` -- broadcast to every rank; (None, None): start from scratch.
    Collective; a failure is the same :class:`CheckpointError` on every rank."""
    decision: list = [None]
    if ps.rank == 0:
        try:
            iteration = choose_iteration(root, step, save_dir=save_dir, finetune=finetune)
            identity = None
            if iteration is not None:
                raw = read_metadata_bytes(iteration_dir(root, iteration))
                identity = hashlib.sha256(raw).hexdigest()
            decision = [(iteration, identity, None)]
        except CheckpointError as exc:
            decision = [(None, None, str(exc))]
    if distributed(ps):
        collectives.broadcast_object_list(decision, src=0)
    iteration, identity, error = decision[0]
    if error is not None:
        raise CheckpointError(error if ps.rank == 0 else f"on rank 0: {error}")
    return iteration, identity


def _check_files(iter_dir: str, identity: str, ps: ParallelState, sha256: bool) -> dict:
    """metadata.json (the one rank 0 chose), then every manifest file's size (all ranks)
    and, with ``sha256``, those checksums (files split over ranks). Collective; returns
    the metadata."""
    meta, error = None, None
    try:
        raw = read_metadata_bytes(iter_dir)
        if hashlib.sha256(raw).hexdigest() != identity:
            raise CheckpointError(
                f"{iter_dir} changed while it was being loaded: this rank reads another "
                "metadata.json than rank 0 did. Is another job saving to this directory? "
                "Stop it, or load a fixed iteration with --ckpt-step")
        meta = parse_metadata(iter_dir, raw)
        names = sorted(meta["files"])
        check_sizes(iter_dir, meta["files"], names)
        if sha256:
            check_checksums(iter_dir, meta["files"], names[ps.rank::ps.world_size],
                            fast=False, sha256=True)
    except CheckpointError as exc:
        error = str(exc)
    raise_if_any(error, ps, "{error}")
    return meta


class _ChecksumThread(threading.Thread):
    """Verifies this rank's share of the files' fast checksums while DCP reads them (the
    hashes release the GIL). ``error`` after :meth:`join`."""

    def __init__(self, iter_dir: str, manifest: dict, names: list[str]):
        super().__init__(name="checkpoint-verify", daemon=True)
        self.args_ = (iter_dir, manifest, names)
        self.error: str | None = None

    def run(self) -> None:
        try:
            check_checksums(*self.args_, fast=True)
        except (CheckpointError, OSError) as exc:
            self.error = str(exc)


def _check_model(layouts, shapes: dict, path: str, ps: ParallelState) -> None:
    """Every parameter present with its global shape, and (over all ranks together) no
    checkpoint tensor that no rank's model has. Collective."""
    error = None
    for layout in layouts:
        saved = saved_global_shape(layout, shapes)
        if saved is None:
            error = (f"checkpoint {path} has no tensor {layout.key!r} that the model has "
                     f"(shape {layout.global_shape})")
        elif saved != layout.global_shape:
            error = (f"tensor {layout.key!r} has shape {saved} in checkpoint {path} but "
                     f"{layout.global_shape} in the model")
        if error:
            break
    raise_if_any(error, ps, "{error}")
    wanted = set()
    for keys in gather_objects(sorted(k for lay in layouts for k in piece_keys(lay)), ps):
        wanted.update(keys)
    unexpected = sorted(set(shapes) - wanted)
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has tensor {unexpected[0]!r} that the "
                              f"model does not have ({len(unexpected)} such)")


def reseed(seed: int, iteration: int, ps: ParallelState, tracker=None) -> None:
    """Deterministic fresh RNG streams for a resumed run whose layout changed: python,
    numpy and torch from ``seed + iteration`` (+100 per pipeline stage, as at start),
    the model-parallel tracker's streams as if built with that seed."""
    from megalite.parallel.random import RNGTracker, stage_seed

    base = seed + iteration
    seed_here = stage_seed(base, ps)
    random.seed(seed_here)
    np.random.seed(seed_here % 2 ** 32)
    torch.manual_seed(seed_here)
    if tracker is not None:
        tracker.set_states(RNGTracker.from_state(ps, base).get_states())


def _read(iter_dir: str, meta: dict, model, optimizer, ps: ParallelState,
          load_optim: bool, load_rng: bool, finetune: bool):
    """Check the model against the checkpoint and read the blocks (collective)."""
    reader = dcp.FileSystemReader(iter_dir)
    entries = reader.read_metadata().state_dict_metadata
    shapes = {k[len("model/"):]: tuple(v.size) for k, v in entries.items()
              if k.startswith("model/") and isinstance(v, TensorStorageMetadata)}
    dtypes = {k: v.properties.dtype for k, v in entries.items()
              if isinstance(v, TensorStorageMetadata)}
    layouts = param_layouts(model, ps)
    _check_model(layouts, shapes, iter_dir, ps)

    state, pieces = model_load_state(layouts)
    state[COMMON] = None
    names = meta.get("optimizer_state")
    want_optim = load_optim and not finetune and optimizer is not None
    if want_optim and names is None:
        raise CheckpointError(f"{iter_dir} holds no optimizer state (saved with "
                              "--no-save-optim); load it with --no-load-optim")
    per_param = None
    if want_optim:
        ostate, opieces, per_param = optimizer_load_state(layouts, names, dtypes)
        state.update(ostate)
        pieces.update(opieces)
    same_layout = meta["layout"] == layout_of(ps)
    want_rng = load_rng and not finetune
    if want_rng and not meta.get("rng"):
        raise CheckpointError(f"{iter_dir} holds no RNG state (saved with --no-save-rng); "
                              "load it with --no-load-rng")
    if want_rng and same_layout:
        state[rng_key(ps.rank)] = None
    load_blocks(state, pieces, reader, no_dist=not distributed(ps))

    return state[COMMON], per_param, want_optim, want_rng, same_layout, state


def load_checkpoint(root: str, model, optimizer, scheduler, ps: ParallelState, *,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    rng_tracker=None, iteration: int | None = None,
                    save_dir: str | None = None, verify: bool = True,
                    sha256: bool = False) -> LoadedCheckpoint | None:
    """Restore the latest (or ``iteration``'s) checkpoint under ``root`` into the objects,
    resharding to this layout. Collective over the world.

    Returns None -- start from scratch -- only when ``root`` holds no checkpoint and
    ``save_dir`` is the same directory (see :func:`megalite.checkpoint.files.find_iteration`
    for the rules). ``finetune``: weights only; iteration and consumed samples restart at
    0. ``load_optim`` False: fresh optimizer moments and loss scaler (the lr schedule
    still continues). ``load_rng`` False: keep this run's seeds. ``iteration``
    (``--ckpt-step``): that one instead of the latest. ``verify`` (default; off with
    ``--no-ckpt-verify``): check the files' fast checksums; ``sha256`` (``--ckpt-verify``):
    also their sha256. Raises :class:`CheckpointError` naming the first missing or damaged
    file, or the first tensor whose name or shape differs.
    """
    iteration, identity = resolve_checkpoint(root, ps, step=iteration, save_dir=save_dir,
                                             finetune=finetune)
    if iteration is None:
        return None
    iter_dir = iteration_dir(root, iteration)
    meta = _check_files(iter_dir, identity, ps, sha256)
    checker = None
    if verify:
        names = sorted(meta["files"])
        checker = _ChecksumThread(iter_dir, meta["files"], names[ps.rank::ps.world_size])
        checker.start()
    try:
        common, per_param, want_optim, want_rng, same_layout, state = _read(
            iter_dir, meta, model, optimizer, ps, load_optim, load_rng, finetune)
    except Exception as exc:
        if checker is not None:
            checker.join()
            if checker.error is not None:  # the damage explains the failure
                raise CheckpointError(f"{checker.error}; "
                                      f"{fallback_hint(root, iteration)}") from exc
        raise
    if checker is not None:
        checker.join()
        raise_if_any(checker.error, ps, "{error}; " + fallback_hint(root, iteration)
                     + " (or pass --no-ckpt-verify to load this one as it is)")
    if optimizer is not None:
        optimizer.reload_model_params()
    if finetune:
        return LoadedCheckpoint(iteration=0, consumed_samples=0, path=iter_dir)
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
    if want_optim:
        optimizer.load_state_dict_per_param({"step": common["optimizer"]["step"],
                                             "params": per_param})
        if common.get("loss_scaler") is not None:
            optimizer.scaler.load_state_dict(common["loss_scaler"])
    if want_rng and same_layout:
        restore_rng_state(state[rng_key(ps.rank)], rng_tracker, ps.device)
    elif want_rng:
        seed = (meta.get("config") or {}).get("train", {}).get("seed", 1234)
        reseed(seed, int(common["iteration"]), ps, rng_tracker)
        if ps.rank == 0:
            old = meta["layout"]
            print(f" checkpoint {iter_dir} was saved at tp={old['tp']} pp={old['pp']} "
                  f"dp={old['dp']} ep={old['ep']} (world {old['world_size']}); resharded to "
                  f"tp={ps.tp.size} pp={ps.pp.size} dp={ps.dp.size} ep={ps.ep.size}. RNG "
                  f"states are per rank and were not restored: re-seeded from seed {seed} "
                  f"+ iteration {common['iteration']}", flush=True)
    return LoadedCheckpoint(iteration=int(common["iteration"]),
                            consumed_samples=int(common["consumed_samples"]), path=iter_dir,
                            layout_changed=not same_layout,
                            rng_restored=want_rng and same_layout)

