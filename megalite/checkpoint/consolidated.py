"""A checkpoint as one full (unsharded, layout-free) model state dict, in one process.

Because a checkpoint is layout-free, reading it whole is just loading it at tp=pp=dp=1:
:func:`load_full_model` builds the GPT of the checkpoint's recorded config in this
process and loads it; :func:`save_full_model` writes a full state dict as a checkpoint
(weights only, iteration 0) that any layout can ``--load ... --finetune``. Both run
without torch.distributed (or on a world of one).
"""

from __future__ import annotations

import os

import torch

from megalite.checkpoint.files import (
    LATEST,
    CheckpointError,
    iteration_dir,
    published_iterations,
    read_latest_iteration,
    read_metadata,
)
from megalite.checkpoint.load import LoadOptions, load_checkpoint
from megalite.checkpoint.save import save_checkpoint
from megalite.config import ConfigError, MegaliteConfig, ParallelConfig
from megalite.parallel.state import ParallelState


def single_process_state() -> ParallelState:
    """The layout of one process (tp = pp = dp = 1)."""
    return ParallelState.build(ParallelConfig(), device=torch.device("cpu"))


def checkpoint_config(root: str, iteration: int | None = None) -> tuple[MegaliteConfig, int]:
    """The run configuration recorded in the checkpoint, and its iteration.

    Its errors name no command-line flag (tools call this with their own flags)."""
    held = published_iterations(root)
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None and held:
            raise CheckpointError(
                f"{root} holds iterations {', '.join(map(str, held))} but no {LATEST}; "
                f"choose one explicitly")
        if iteration is None:
            if os.path.exists(root) and not os.path.isdir(root):
                raise CheckpointError(f"{root} is a file, not a checkpoint directory")
            what = ("does not exist" if not os.path.exists(root) else
                    "holds no megalite checkpoint")
            if os.path.exists(os.path.join(root, "config.json")):
                what += " (it looks like a Hugging Face model)"
            raise CheckpointError(f"{root}: the directory {what}")
    elif iteration not in held:
        what = (f"available: {', '.join(map(str, held))}" if held else
                "it holds no published iteration")
        raise CheckpointError(f"{root} has no iteration {iteration}; {what}")
    meta = read_metadata(iteration_dir(root, iteration))
    try:
        return MegaliteConfig.from_dict(meta["config"]), iteration
    except ConfigError as exc:
        raise CheckpointError(f"{iteration_dir(root, iteration)}: {exc}") from None


def load_full_model(root: str, iteration: int | None = None):
    """(config, GPTModel at tp=1 holding the checkpoint's weights, fp32) of ``root``."""
    from megalite.models.gpt import GPTModel

    cfg, iteration = checkpoint_config(root, iteration)
    cfg.model.bf16 = cfg.model.fp16 = False
    ps = single_process_state()
    model = GPTModel(cfg.model, ps, seed=cfg.train.seed)
    load_checkpoint(root, model, None, None, ps,
                    LoadOptions(load_rng=False, iteration=iteration))
    return cfg, model


def _pad_rows(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` with zero rows appended up to ``shape`` (a vocabulary padded further here than
    in the source, as the full state dict drops padding rows)."""
    if t.shape == shape or t.shape[1:] != shape[1:] or t.shape[0] > shape[0]:
        return t
    return torch.cat([t, t.new_zeros(shape[0] - t.shape[0], *t.shape[1:])])


def save_full_model(cfg: MegaliteConfig, state: dict[str, torch.Tensor], root: str,
                    optimizer_state=None) -> str:
    """Write the full state dict ``state`` (names as ``GPTModel.full_state_dict()``) of
    the model ``cfg.model`` as a weights-only checkpoint of iteration 0 under ``root``;
    with ``optimizer_state`` (a :class:`~megalite.checkpoint.megatron.optimizer.
    MegatronOptimizerState`: full per-parameter state in the same names, the step count,
    the iteration, consumed samples) a checkpoint of that iteration that resumes training:
    the optimizer of ``cfg.optim`` holding that state and the lr schedule's position."""
    from megalite.models.gpt import GPTModel

    ps = single_process_state()
    model = GPTModel(cfg.model, ps, seed=cfg.train.seed)
    model.load_full_state_dict(state)
    if optimizer_state is None:
        return save_checkpoint(root, 0, model, None, None, ps, cfg.to_dict(), 0,
                               save_optim=False, save_rng=False)
    from megalite.config.layout import resolve_layout
    from megalite.optim.build import build_grads_and_optimizer
    from megalite.optim.lr_schedule import LRScheduler

    s = optimizer_state
    _, optimizer = build_grads_and_optimizer(model, cfg, ps)
    missing = sorted(set(optimizer.names) - set(s.params))
    if missing:
        raise KeyError(f"no optimizer state for {', '.join(missing[:3])}")
    shapes = dict(model.named_parameters())
    optimizer.load_state_dict_per_param({"step": s.step, "params": {
        name: {k: _pad_rows(x, shapes[name].shape) for k, x in s.params[name].items()}
        for name in optimizer.names}})
    if s.loss_scaler is not None and hasattr(optimizer.scaler, "clean_steps"):
        optimizer.scaler.load_state_dict(s.loss_scaler)   # an fp16 run's dynamic scale
    scheduler = LRScheduler.for_run(cfg, resolve_layout(cfg, 1).batch_schedule)
    scheduler.num_steps = (s.scheduler_samples if scheduler.unit == "samples"
                           and s.scheduler_samples is not None else s.iteration)
    return save_checkpoint(root, s.iteration, model, optimizer, scheduler, ps, cfg.to_dict(),
                           s.consumed_samples, save_rng=False)


def load_full_training_state(root: str, iteration: int | None = None):
    """Where the run of ``root``'s checkpoint (iteration ``iteration``, default the latest)
    stood, read whole in one process: ``(config, weights, optimizer state, scheduler)``
    with ``weights`` the full fp32 state dict (names as ``GPTModel.full_state_dict()``),
    ``optimizer state`` ``{"step", "iteration", "consumed_samples", "params": {name:
    {state name: full fp32 tensor}}}`` (the per-parameter form of
    :mod:`megalite.optim.optimizer_state`: ``exp_avg`` / ``exp_avg_sq``, ``momentum_buffer``,
    ``master`` for a bf16 / fp16 model's fp32 weights; vocabulary padding rows dropped;
    and ``"loss_scaler"``, the loss scaler's state)
    and the lr ``scheduler`` at its saved position; the last two None where the
    checkpoint holds no optimizer state."""
    import dataclasses

    from megalite.config.layout import resolve_layout
    from megalite.models.gpt import GPTModel
    from megalite.optim.build import build_grads_and_optimizer
    from megalite.optim.lr_schedule import LRScheduler

    cfg, iteration = checkpoint_config(root, iteration)
    if not read_metadata(iteration_dir(root, iteration)).get("optimizer_state"):
        return cfg, load_full_model(root, iteration)[1].full_state_dict(), None, None
    # one process: the saved layout's sizes dropped, its optimizer sharding kept
    one = dataclasses.replace(cfg, parallel=ParallelConfig(
        data_parallel_sharding_strategy=cfg.parallel.data_parallel_sharding_strategy))
    one = MegaliteConfig.from_dict(one.to_dict())   # (a copy: cfg is returned as saved)
    ps = single_process_state()
    model = GPTModel(one.model, ps, seed=one.train.seed)
    _, optimizer = build_grads_and_optimizer(model, one, ps)
    scheduler = LRScheduler.for_run(one, resolve_layout(one, 1).batch_schedule)
    loaded = load_checkpoint(root, model, optimizer, scheduler, ps,
                             LoadOptions(load_rng=False, iteration=iteration))
    per = optimizer.state_dict_per_param()
    # (the weights as load_full_model gives them: fp32, whatever the run's precision)
    weights = {k: t.float() for k, t in model.full_state_dict().items()}
    params = {name: {k: t.float()[:weights[name].shape[0]] if t.dim() else t.float()
                     for k, t in entry.items()}
              for name, entry in per["params"].items()}
    state = {"step": int(per["step"]), "iteration": loaded.iteration,
             "consumed_samples": loaded.consumed_samples, "params": params,
             "loss_scaler": optimizer.scaler.state_dict()}
    return cfg, weights, state, scheduler
