"""Start-up checks, run by ``build_components`` before any training work.

* The output locations can be written: ``--save`` (every rank writes its shards there),
  ``--tensorboard-dir`` and the directory of ``--metrics-jsonl`` (on the logging rank).
  Each is created if missing and must take a temporary file; otherwise
  :class:`StartupError` names the flag and the path, on every rank (a rank whose own
  paths are fine says which rank failed), before any step is taken.
* Free disk space under ``--save`` for one checkpoint of this model, estimated as
  parameters x (bytes per parameter + optimizer bytes per parameter): a shortfall is a
  warning naming the numbers, not an error (the estimate is rough, and space may be freed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import torch

from megalite.config import ConfigError, MegaliteConfig
from megalite.parallel.collectives import ReduceOp, all_reduce_scalar
from megalite.parallel.state import ParallelState


class StartupError(ConfigError):
    """An output location named by a flag cannot be written."""


def unwritable_reason(directory: str) -> str | None:
    """Why ``directory`` cannot be created or take a new file, or None when it can."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def output_dirs(cfg: MegaliteConfig, ps: ParallelState, log_rank: int) -> list[tuple]:
    """[(flag, value as given, directory to check)] this rank writes to."""
    dirs = []
    if cfg.checkpoint.save:
        dirs.append(("--save", cfg.checkpoint.save, cfg.checkpoint.save))
    lg = cfg.logging
    if ps.rank == log_rank:
        if lg.tensorboard_dir:
            dirs.append(("--tensorboard-dir", lg.tensorboard_dir, lg.tensorboard_dir))
        if lg.metrics_jsonl:
            dirs.append(("--metrics-jsonl", lg.metrics_jsonl,
                         os.path.dirname(os.path.abspath(lg.metrics_jsonl))))
    return dirs


def check_output_dirs(cfg: MegaliteConfig, ps: ParallelState, log_rank: int) -> None:
    """Raise :class:`StartupError` on every rank when any rank cannot write its outputs."""
    error = None
    for flag, value, directory in output_dirs(cfg, ps, log_rank):
        reason = unwritable_reason(directory)
        if reason is not None:
            where = "" if directory == value else f" (its directory {directory})"
            error = (f"{flag} {value}: cannot create or write{where}: {reason}; choose a "
                     "writable location")
            break
    failed = all_reduce_scalar(ps.rank if error else -1, None, ReduceOp.MAX, ps.device) \
        if ps.world_size > 1 else (ps.rank if error else -1)
    if error:
        raise StartupError(error)
    if failed >= 0:
        raise StartupError(f"rank {int(failed)} cannot write its output locations (see its "
                           "error); stopping before any work")


def checkpoint_bytes(cfg: MegaliteConfig, model: torch.nn.Module, ps: ParallelState) -> int:
    """Estimated size of one checkpoint: unique parameters (all ranks' shards, data-parallel
    replicas counted once) x (bytes per parameter + optimizer state bytes per parameter)."""
    local = sum(p.numel() for p in model.parameters())
    total = all_reduce_scalar(local, None, ReduceOp.SUM, ps.device) if ps.world_size > 1 \
        else local
    params = total / max(ps.dp.size, 1)
    param_bytes = next((p.element_size() for p in model.parameters()), 4)
    optim_bytes = 0
    if not cfg.checkpoint.no_save_optim:
        from megalite.optim.algorithms import algorithm_of

        moments = algorithm_of(cfg.optim).state_floats(cfg.optim)
        main_params = 4 if param_bytes < 4 else 0  # fp32 master copy under bf16/fp16
        optim_bytes = 4 * moments + main_params
    return int(params * (param_bytes + optim_bytes))


def check_disk_space(cfg: MegaliteConfig, model: torch.nn.Module, ps: ParallelState,
                     warn: Callable[[str], None] = print) -> None:
    """``warn`` (rank 0) when ``--save`` has less free space than one checkpoint needs."""
    if not cfg.checkpoint.save:
        return
    need = checkpoint_bytes(cfg, model, ps)
    if ps.rank != 0:
        return
    free = shutil.disk_usage(cfg.checkpoint.save).free
    if free < need:
        gb = 1 << 30
        warn(f"megalite: warning: --save {cfg.checkpoint.save}: {free / gb:.2f} GiB free, but one "
             f"checkpoint of this model needs about {need / gb:.2f} GiB (estimated); "
             f"{(need - free) / gb:.2f} GiB short: free space or choose another --save")


def preflight(cfg: MegaliteConfig, model: torch.nn.Module, ps: ParallelState,
              log_rank: int, warn: Callable[[str], None] = print) -> None:
    """The start-up checks of this module (collective: every rank calls it)."""
    check_output_dirs(cfg, ps, log_rank)
    check_disk_space(cfg, model, ps, warn)
