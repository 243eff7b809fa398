"""Loading checkpoints under any layout: :func:`load_checkpoint`.

Every rank reads only the overlap of its own blocks with the saved ones (DCP resharding),
so a checkpoint saved at (tp2, pp2, dp2) loads at (tp1, pp1, dp1) or (tp4, pp1, dp2).
Model weights are read straight into the parameters; optimizer state into fresh tensors
handed to the optimizer. RNG states are per rank and cannot be resharded: they are
restored only when the layout is unchanged, otherwise every generator is re-seeded from
(seed, iteration) and the log says so.

All checks (files, manifest, names and shapes) agree across ranks before any rank starts
reading, so a bad checkpoint is one :class:`CheckpointError` everywhere, not a hang.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import TensorStorageMetadata

from megalite.checkpoint.files import (
    CheckpointError,
    find_iteration,
    iteration_dir,
    read_metadata,
    verify_files,
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
from megalite.parallel.state import ParallelState


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored."""

    iteration: int
    consumed_samples: int
    path: str
    layout_changed: bool = False
    rng_restored: bool = False


def _check_files(iter_dir: str, ps: ParallelState, verify: bool) -> dict:
    """metadata.json, then every manifest file's size (all ranks) and, with ``verify``,
    checksums (files split over ranks). Collective; returns the metadata."""
    meta, error = None, None
    try:
        meta = read_metadata(iter_dir)
        names = sorted(meta["files"])
        verify_files(iter_dir, meta["files"], names, checksums=False)
        if verify:
            mine = names[ps.rank::ps.world_size]
            verify_files(iter_dir, meta["files"], mine, checksums=True)
    except CheckpointError as exc:
        error = str(exc)
    raise_if_any(error, ps, "{error}")
    return meta


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


def load_checkpoint(root: str, model, optimizer, scheduler, ps: ParallelState, *,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    rng_tracker=None, iteration: int | None = None,
                    save_dir: str | None = None, verify: bool = False
                    ) -> LoadedCheckpoint | None:
    """Restore the latest (or ``iteration``'s) checkpoint under ``root`` into the objects,
    resharding to this layout. Collective over the world.

    Returns None -- start from scratch -- only when ``root`` holds no checkpoint and
    ``save_dir`` is the same directory (see :func:`megalite.checkpoint.files.find_iteration`
    for the rules). ``finetune``: weights only; iteration and consumed samples restart at
    0. ``load_optim`` False: fresh optimizer moments and loss scaler (the lr schedule
    still continues). ``load_rng`` False: keep this run's seeds. ``verify``: check the
    files' sha256 against the manifest. Raises :class:`CheckpointError` naming the first
    missing or damaged file, or the first tensor whose name or shape differs.
    """
    if iteration is None:
        iteration = find_iteration(root, save_dir=save_dir, finetune=finetune)
        if iteration is None:
            return None
    iter_dir = iteration_dir(root, iteration)
    meta = _check_files(iter_dir, ps, verify)
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

    common = state[COMMON]
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
        restore_rng_state(state[rng_key(ps.rank)], rng_tracker)
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

