"""Checkpoints as one ``torch.save`` file per model-parallel rank (Megatron-LM's layout)::

    SAVE/
      latest_checkpointed_iteration.txt      "10" -- written last, atomically
      iter_0000010/
        metadata.json                        rank 0: iteration, layout, config, files
        mp_rank_00_000/model_optim_rng.pt    tp rank 00, pp rank 000
        mp_rank_01_000/model_optim_rng.pt

Data-parallel replicas hold the same model and optimizer, so only data-parallel rank 0 of
each (tp, pp) coordinate writes; the RNG states of all its data-parallel peers go into its
file (``rng_state`` is a list indexed by dp rank).

Crash safety: the iteration directory is written as ``iter_0000010.tmp``; only when every
rank reports its file written and fsynced does rank 0 rename it to ``iter_0000010`` and
then replace the ``latest`` pointer. A crash (or an exception on any rank) before that
leaves the previous checkpoint as latest and intact; a stale ``.tmp`` is removed by the
next save.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.checkpoint.rng import gather_rng_states, restore_rng_state
from megalite.optim.comm import all_reduce_scalar
from megalite.parallel.state import ParallelState

FORMAT = "megalite-per-rank-v1"
LATEST = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or does not fit the model."""


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored."""

    iteration: int
    consumed_samples: int
    path: str


# -- paths ------------------------------------------------------------------------------
def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(iter_dir: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(iter_dir, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}", FILE_NAME)


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


# -- small filesystem helpers ------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_file(state: dict, path: str) -> None:
    """torch.save ``state`` to ``path`` and fsync it (tests patch this to inject crashes)."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to a temporary file, fsync it, then ``os.replace`` it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _all_ok(ok: bool, ps: ParallelState) -> bool:
    """MIN over the world of ``ok``: True only if every rank succeeded (collective)."""
    return all_reduce_scalar(float(ok), None, dist.ReduceOp.MIN, ps.device) > 0


# -- save -------------------------------------------------------------------------------
def save_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer, scheduler,
                    ps: ParallelState, config: dict, consumed_samples: int, *,
                    save_optim: bool = True, save_rng: bool = True,
                    rng_tracker=None) -> str:
    """Write a checkpoint of ``iteration`` under ``root`` (collective over the world).

    ``optimizer`` is a :class:`megalite.optim.optimizer.MixedPrecisionOptimizer` (its loss
    scaler is saved with it), ``scheduler`` an :class:`megalite.optim.lr_schedule.LRScheduler`,
    ``config`` the run's ``MegaliteConfig.to_dict()``. Returns the iteration directory.
    Raises :class:`CheckpointError` on every rank if any rank failed; the previous latest
    checkpoint is then untouched.
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    writer = ps.dp_cp.rank == 0
    rng = gather_rng_states(ps.dp_cp, rng_tracker) if save_rng else None

    error = None
    if ps.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            error = exc
    if not _all_ok(error is None, ps):
        raise CheckpointError(f"cannot create {tmp}: {error}")

    if writer:
        state = {
            "format": FORMAT,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "model": model.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng_state": rng,
            "layout": _layout(ps),
            "config": config,
        }
        if save_optim and optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
            state["loss_scaler"] = optimizer.scaler.state_dict()
        try:
            path = rank_file(tmp, ps.tp.rank, ps.pp.rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_rank_file(state, path)
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            error = exc
    if not _all_ok(error is None, ps):
        raise CheckpointError(f"saving iteration {iteration} to {root} failed "
                              f"({'here: ' + repr(error) if error else 'on another rank'}); "
                              f"the previous checkpoint is unchanged")

    if ps.rank == 0:
        try:
            _publish(root, tmp, final, iteration, consumed_samples, ps, config)
        except OSError as exc:
            error = exc
    if not _all_ok(error is None, ps):
        raise CheckpointError(f"publishing {final} failed: {error}")
    return final


def _layout(ps: ParallelState) -> dict:
    return {"tp": ps.tp.size, "pp": ps.pp.size, "dp": ps.dp.size, "cp": ps.cp.size,
            "world_size": ps.world_size}


def _publish(root: str, tmp: str, final: str, iteration: int, consumed_samples: int,
             ps: ParallelState, config: dict) -> None:
    """Rank 0, after every rank wrote: metadata, rename the directory, move ``latest``."""
    files = sorted(os.path.relpath(os.path.join(d, f), tmp)
                   for d, _, fs in os.walk(tmp) for f in fs)
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
            "layout": _layout(ps), "files": files, "time": time.time(), "config": config}
    _write_text_atomic(os.path.join(tmp, "metadata.json"), json.dumps(meta, indent=1))
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving an iteration (e.g. after a resume)
        old = f"{final}.old{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(os.path.join(root, LATEST), f"{iteration}\n")


# -- load -------------------------------------------------------------------------------
def load_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler,
                    ps: ParallelState, *, load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False, rng_tracker=None,
                    iteration: int | None = None) -> LoadedCheckpoint | None:
    """Restore the latest (or ``iteration``'s) checkpoint under ``root`` into the objects.

    Returns None when ``root`` holds no checkpoint (training starts from scratch).
    ``finetune``: weights only, iteration and consumed samples restart at 0.
    ``load_optim`` False: fresh optimizer moments and loss scaler (the lr schedule still
    continues from the checkpoint's step). ``load_rng`` False: keep this run's seeds.
    Raises :class:`CheckpointError` naming the first tensor whose name or shape differs.
    """
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None:
            return None
    iter_dir = iteration_dir(root, iteration)
    path = rank_file(iter_dir, ps.tp.rank, ps.pp.rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist{_saved_layout_hint(iter_dir, ps)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint "
                              f"(format {state.get('format')!r})")

    check_model_state(state["model"], model, path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.reload_model_params()
    if finetune:
        return LoadedCheckpoint(iteration=0, consumed_samples=0, path=iter_dir)

    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if load_optim and optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds no optimizer state (saved with "
                                  "--no-save-optim); load it with --no-load-optim")
        optimizer.load_state_dict(state["optimizer"])
        optimizer.scaler.load_state_dict(state["loss_scaler"])
    if load_rng:
        rng = state.get("rng_state")
        if rng is None:
            raise CheckpointError(f"{path} holds no RNG state (saved with --no-save-rng); "
                                  "load it with --no-load-rng")
        index = ps.dp_cp.rank if len(rng) == ps.dp_cp.size else 0
        restore_rng_state(rng[index], rng_tracker)
    return LoadedCheckpoint(iteration=int(state["iteration"]),
                            consumed_samples=int(state["consumed_samples"]), path=iter_dir)


def check_model_state(saved: dict, model: torch.nn.Module, path: str) -> None:
    """Raise :class:`CheckpointError` naming the first tensor missing, unexpected or of
    another shape in ``saved`` compared to ``model.state_dict()``."""
    live = model.state_dict()
    for name, tensor in live.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {name!r} that the model "
                                  f"has (shape {tuple(tensor.shape)})")
        other = saved[name]
        if isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor) \
                and tuple(other.shape) != tuple(tensor.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(other.shape)} in "
                                  f"checkpoint {path} but {tuple(tensor.shape)} in the model")
    for name in saved:
        if name not in live:
            raise CheckpointError(f"checkpoint {path} has tensor {name!r} that the model "
                                  "does not have")


def _saved_layout_hint(iter_dir: str, ps: ParallelState) -> str:
    meta_path = os.path.join(iter_dir, "metadata.json")
    if not os.path.isdir(iter_dir):
        return f" (no directory {iter_dir})"
    try:
        with open(meta_path) as f:
            layout = json.load(f)["layout"]
    except (OSError, ValueError, KeyError):
        return ""
    return (f": the checkpoint was saved with tp={layout['tp']} pp={layout['pp']}, this run "
            f"has tp={ps.tp.size} pp={ps.pp.size}; this format cannot reshard")
