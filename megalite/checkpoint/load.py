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
crc32, recorded at every save) are verified by default in a thread beside DCP's read
(:mod:`megalite.checkpoint.verify`; each file by one rank, a reader of it where there is
one); a damaged file is named on every rank, with the older complete iteration to fall
back to, before the load returns.

Loading from a directory a live job saves to takes no lock (see
:mod:`megalite.checkpoint.lock`): saves are published whole (``iter_N.tmp`` renamed, then
the ``latest`` pointer), so ``latest`` names a complete iteration. The live job can still
replace a published ``iter_N`` by re-saving that iteration (after resuming from an older
one). Every rank pins the directory it reads (device and inode of ``iter_N`` before the
first byte, compared after the last, the checksums' included): a directory
replaced in between -- files read partly from the old and partly from the new one -- is
detected on every rank together, and the load starts again from rank 0's decision (up to
:data:`READ_ATTEMPTS` times).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint import TensorStorageMetadata
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.files import (
    LATEST,
    CheckpointError,
    check_checksums,
    check_sizes,
    choose_iteration,
    fallback_hint,
    iteration_dir,
    newest_complete_hint,
    parse_metadata,
    read_metadata_bytes,
)
from megalite.checkpoint.layout import (
    fill_mirrors,
    param_layouts,
    piece_keys,
    read_fused_whole_where_saved_so,
    saved_global_shape,
)
from megalite.checkpoint.lock import live_holder
from megalite.checkpoint.planner import load_blocks
from megalite.checkpoint.rng import restore_rng_state
from megalite.checkpoint.save import distributed, gather_objects, layout_of, raise_if_any
from megalite.checkpoint.state import (
    COMMON,
    fp8_load_state,
    model_load_state,
    optimizer_load_state,
    restore_fp8_histories,
    rng_key,
)
from megalite.checkpoint.verify import METADATA_FILE, VerifyingReader
from megalite.parallel import collectives
from megalite.parallel.state import ParallelState

READ_ATTEMPTS = 3   # reads of a directory that a live job replaced while it was read


class _Replaced(Exception):
    """The iteration directory was replaced (re-saved) while this load read it."""


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_checkpoint` loads: the ``--load`` side of the checkpoint flags.

    load_optim: restore the optimizer moments and loss scaler (``--no-load-optim``: fresh
                ones; the lr schedule still continues).
    load_rng:   restore the RNG states (``--no-load-rng``: keep this run's seeds).
    finetune:   weights only; iteration and consumed samples restart at 0 (``--finetune``).
    iteration:  load that iteration instead of the latest (``--ckpt-step``).
    save_dir:   this run's ``--save``: an empty ``--load`` directory starts from scratch
                only when it is the same one
                (:func:`megalite.checkpoint.files.find_iteration`).
    verify:     check the files' fast checksums (``--no-ckpt-verify``: off).
    sha256:     also check their sha256 (``--ckpt-verify``).
    """

    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    iteration: int | None = None
    save_dir: str | None = None
    verify: bool = True
    sha256: bool = False

    @classmethod
    def from_config(cls, ck) -> LoadOptions:
        """The options ``ck`` (a :class:`megalite.config.CheckpointConfig`) asks for."""
        return cls(load_optim=not ck.no_load_optim, load_rng=not ck.no_load_rng,
                   finetune=ck.finetune, iteration=ck.ckpt_step, save_dir=ck.save,
                   verify=not ck.no_ckpt_verify, sha256=ck.ckpt_verify)


@dataclass
class _Load:
    """One load: the checkpoint directory, the objects it restores into, its options."""

    root: str
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    ps: ParallelState
    rng_tracker: object
    options: LoadOptions


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
        for attempt in range(READ_ATTEMPTS):
            iteration = None
            try:
                iteration = choose_iteration(root, step, save_dir=save_dir,
                                             finetune=finetune)
                identity = None
                if iteration is not None:
                    raw = read_metadata_bytes(iteration_dir(root, iteration))
                    identity = hashlib.sha256(raw).hexdigest()
                decision = [(iteration, identity, None)]
            except CheckpointError as exc:
                error = str(exc)
                if (iteration is not None and attempt + 1 < READ_ATTEMPTS
                        and not os.path.isdir(iteration_dir(root, iteration))):
                    time.sleep(0.1)   # between the renames of a live job's re-save
                    continue
                if iteration is not None:   # the iteration chosen is missing or unreadable
                    named = (f"--ckpt-step {step}" if step is not None else
                             f"{LATEST} names iteration {iteration}")
                    error += f" ({named}); {newest_complete_hint(root, exclude=iteration)}"
                decision = [(None, None, error)]
            break
        holder = live_holder(root) if decision[0][0] is not None else None
        if holder is not None:
            print(f" {root}: a live job (host {holder.get('host', '?')}, pid "
                  f"{holder.get('pid', '?')}) is saving to it; reading iteration "
                  f"{decision[0][0]}, its newest published one", flush=True)
    if distributed(ps):
        collectives.broadcast_object_list(decision, src=0)
    iteration, identity, error = decision[0]
    if error is not None:
        raise CheckpointError(error if ps.rank == 0 else f"on rank 0: {error}")
    return iteration, identity


def _pin(iter_dir: str) -> tuple[int, int] | None:
    """(device, inode) of the directory the path names now; None when it names none."""
    try:
        st = os.stat(iter_dir)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _agree(error: str | None, replaced: str | None, ps: ParallelState, hint=str) -> None:
    """Collective: :class:`_Replaced` on every rank when any rank saw its directory
    replaced; else the first rank's ``error`` (+ ``hint()``) as a :class:`CheckpointError`."""
    outcomes = gather_objects((error, replaced), ps)
    moved = next(((r, m) for r, (_, m) in enumerate(outcomes) if m is not None), None)
    if moved is not None:
        raise _Replaced(_where(moved[0], ps) + moved[1])
    first = next(((r, e) for r, (e, _) in enumerate(outcomes) if e is not None), None)
    if first is not None:
        raise CheckpointError(f"{_where(first[0], ps)}{first[1]}{hint()}")


def _where(rank: int, ps: ParallelState) -> str:
    """The prefix naming the rank an error happened on: none on that rank itself (its
    report already names it)."""
    return "" if rank == ps.rank else f"on rank {rank}: "


def _replaced(iter_dir: str, pin) -> str | None:
    if _pin(iter_dir) != pin:
        return f"{iter_dir} was replaced while it was read (a live job re-saved it)"
    return None


def _check_files(iter_dir: str, identity: str, ps: ParallelState, sha256: bool,
                 verify: bool, hint) -> tuple[dict, tuple | None]:
    """metadata.json (the one rank 0 chose), then every manifest file's size (all ranks),
    with ``verify`` the fast checksum of DCP's ``.metadata`` (all ranks: each reads it
    before any plan exists) and, with ``sha256``, those checksums (files split over
    ranks). Collective; returns the metadata and this rank's pin of the directory
    (:func:`_pin`, taken first). An error ends with ``hint(checksum)`` (the fix),
    ``checksum`` telling whether a checksum found it."""
    meta, error, moved, checksum = None, None, None, False
    pin = _pin(iter_dir)
    try:
        raw = read_metadata_bytes(iter_dir)
        if hashlib.sha256(raw).hexdigest() != identity:
            moved = (f"{iter_dir} changed after rank 0 chose it: this rank reads another "
                     "metadata.json (a live job re-saved it)")
        else:
            meta = parse_metadata(iter_dir, raw)
            names = sorted(meta["files"])
            check_sizes(iter_dir, meta["files"], names)
            checksum = True
            if verify and METADATA_FILE in meta["files"]:
                check_checksums(iter_dir, meta["files"], [METADATA_FILE], fast=True)
            if sha256:
                check_checksums(iter_dir, meta["files"], names[ps.rank::ps.world_size],
                                fast=False, sha256=True)
    except CheckpointError as exc:
        error = str(exc) + hint(checksum)
        moved = _replaced(iter_dir, pin)
    _agree(error, moved, ps)
    return meta, pin


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
    mine = {k for lay in layouts for k in piece_keys(lay)}
    mine.update(piece.key for lay in layouts for piece in lay.pieces)   # saved whole
    for keys in gather_objects(sorted(mine), ps):
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


def _read(load: _Load, iter_dir: str, meta: dict, reader: VerifyingReader):
    """Check the model against the checkpoint and read the blocks (collective)."""
    ps, opts = load.ps, load.options
    entries = reader.read_metadata().state_dict_metadata
    shapes = {k[len("model/"):]: tuple(v.size) for k, v in entries.items()
              if k.startswith("model/") and isinstance(v, TensorStorageMetadata)}
    dtypes = {k: v.properties.dtype for k, v in entries.items()
              if isinstance(v, TensorStorageMetadata)}
    layouts = param_layouts(load.model, ps)
    read_fused_whole_where_saved_so(layouts, shapes)
    _check_model(layouts, shapes, iter_dir, ps)

    state, pieces = model_load_state(layouts)
    state[COMMON] = None
    names = meta.get("optimizer_state")
    want_optim = opts.load_optim and not opts.finetune and load.optimizer is not None
    saved = ((meta.get("config") or {}).get("optim") or {}).get("optimizer")
    running = getattr(getattr(load.optimizer, "ocfg", None), "optimizer", None)
    if want_optim and saved and running and saved != running:
        raise CheckpointError(f"{iter_dir} holds --optimizer {saved} state and this run "
                              f"uses --optimizer {running}; load it with --no-load-optim to "
                              f"start {running}'s state fresh (the weights load as they are)")
    if want_optim and names is None:
        raise CheckpointError(f"{iter_dir} holds no optimizer state (saved with "
                              "--no-save-optim); load it with --no-load-optim")
    per_param = None
    if want_optim:
        ostate, opieces, per_param = optimizer_load_state(layouts, names, dtypes)
        state.update(ostate)
        pieces.update(opieces)
    same_layout = meta["layout"] == layout_of(ps)
    want_rng = opts.load_rng and not opts.finetune
    if want_rng and not meta.get("rng"):
        raise CheckpointError(f"{iter_dir} holds no RNG state (saved with --no-save-rng); "
                              "load it with --no-load-rng")
    if want_rng and same_layout:
        state[rng_key(ps.rank)] = None
    fp8_pairs = []
    if not opts.finetune:   # delayed fp8 scaling's amax histories, replicated
        saved = {k: tuple(v.size) for k, v in entries.items()
                 if k.startswith("fp8/") and isinstance(v, TensorStorageMetadata)}
        fstate, fpieces, fp8_pairs = fp8_load_state(load.model, saved)
        state.update(fstate)
        pieces.update(fpieces)
    load_blocks(state, pieces, reader, no_dist=not distributed(ps))
    fill_mirrors(layouts, per_param)
    restore_fp8_histories(fp8_pairs)

    return state[COMMON], per_param, want_optim, want_rng, same_layout, state


def load_checkpoint(root: str, model, optimizer, scheduler, ps: ParallelState,
                    options: LoadOptions | None = None, rng_tracker=None
                    ) -> LoadedCheckpoint | None:
    """Restore the latest (or ``options.iteration``'s) checkpoint under ``root`` into the
    model, optimizer, scheduler and ``rng_tracker`` (each but the model may be None),
    resharding to this layout. Collective over the world.

    ``options``: :class:`LoadOptions` (default: everything, the latest iteration, fast
    checksums verified). Returns None -- start from scratch -- only when ``root`` holds no
    checkpoint and ``options.save_dir`` is the same directory (see
    :func:`megalite.checkpoint.files.find_iteration` for the rules). Raises
    :class:`CheckpointError` naming the first missing or damaged file, or the first
    tensor whose name or shape differs. A directory that a live job replaced while it was
    read is read again (module docstring).
    """
    opts = options if options is not None else LoadOptions()
    load = _Load(root, model, optimizer, scheduler, ps, rng_tracker, opts)
    replaced = None
    for _ in range(READ_ATTEMPTS):
        iteration, identity = resolve_checkpoint(root, ps, step=opts.iteration,
                                                 save_dir=opts.save_dir,
                                                 finetune=opts.finetune)
        if iteration is None:
            return None
        try:
            return _load_iteration(load, iteration, identity)
        except _Replaced as exc:
            replaced = str(exc)
            if ps.rank == 0:
                print(f" {replaced}: reading it again", flush=True)
    raise CheckpointError(f"{replaced}; {READ_ATTEMPTS} reads in a row: another job keeps "
                          f"re-saving {root}, or the ranks see different files there; stop "
                          "that job, or load once it has stopped")


def _load_iteration(load: _Load, iteration: int, identity: str) -> LoadedCheckpoint:
    """One read of ``iteration`` (rank 0's choice, ``identity`` the sha256 of its
    metadata.json); :class:`_Replaced` on every rank when its directory was replaced."""
    root, ps, verify = load.root, load.ps, load.options.verify
    optimizer, scheduler = load.optimizer, load.scheduler
    iter_dir = iteration_dir(root, iteration)

    def hint(checksum: bool = True) -> str:
        """The fix: the older complete checkpoint; for a checksum mismatch also
        --no-ckpt-verify (sizes and metadata are checked with or without it)."""
        skip = " (or pass --no-ckpt-verify to load this one as it is)" if checksum else ""
        return f"; {fallback_hint(root, iteration)}{skip}"

    meta, pin = _check_files(iter_dir, identity, ps, load.options.sha256, verify, hint)
    reader = VerifyingReader(iter_dir, meta["files"] if verify else None, ps.rank,
                             ps.world_size)
    try:
        common, per_param, want_optim, want_rng, same_layout, state = _read(
            load, iter_dir, meta, reader)
    except (Exception, CheckpointException):  # on every rank (the checks and DCP agree)
        # damage that broke the read explains it: named on every rank, else the error
        # (DCP's CheckpointException is a BaseException)
        _agree(reader.outcome(failed=True), _replaced(iter_dir, pin), ps,
               lambda: f"; {fallback_hint(root, iteration)}")
        raise
    _agree(reader.outcome(), _replaced(iter_dir, pin), ps, hint)
    if optimizer is not None:
        optimizer.reload_model_params()
    if load.options.finetune:
        return LoadedCheckpoint(iteration=0, consumed_samples=0, path=iter_dir)
    if scheduler is not None and common.get("scheduler") is not None:
        scheduler.load_state_dict(common["scheduler"])
    if want_optim:
        optimizer.load_state_dict_per_param({"step": common["optimizer"]["step"],
                                             "params": per_param})
        if common.get("loss_scaler") is not None:
            optimizer.scaler.load_state_dict(common["loss_scaler"])
        betas = _lion_betas_changed(meta, optimizer.ocfg)
        if betas and ps.rank == 0:
            print(f" checkpoint {iter_dir}: its Lion ran with betas {betas[0]}; this run's "
                  f"--lion-beta1/2 give {betas[1]} (a Megatron-LM run's --optimizer lion "
                  "takes its --adam-beta1/2 as Lion's betas: pass those as --lion-beta1/2 to "
                  "continue as it trained)", flush=True)
    if want_rng and same_layout:
        restore_rng_state(state[rng_key(ps.rank)], load.rng_tracker, ps.device)
    elif want_rng:
        seed = (meta.get("config") or {}).get("train", {}).get("seed", 1234)
        reseed(seed, int(common["iteration"]), ps, load.rng_tracker)
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


def _lion_betas_changed(meta: dict, ocfg) -> tuple[tuple, tuple] | None:
    """(the checkpoint's Lion betas, this run's) where both runs step with Lion and the
    betas differ; None otherwise."""
    from megalite.config.optim import uses_lion

    saved = (meta.get("config") or {}).get("optim") or {}
    if not (uses_lion(saved.get("optimizer"), saved.get("muon_scalar_optimizer"))
            and uses_lion(ocfg.optimizer, ocfg.muon_scalar_optimizer)):
        return None
    old = (saved.get("lion_beta1", 0.95), saved.get("lion_beta2", 0.98))
    new = (ocfg.lion_beta1, ocfg.lion_beta2)
    return (old, new) if tuple(old) != new else None
