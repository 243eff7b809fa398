"""Build everything a training run needs from a validated config and a ParallelState.

    components = build_components(cfg, ps)      # tokenizer, model, optimizer, data, ...
    result = train(components)                  # megalite.training.loop
    components.close()

Order matters for exact resumption: seeds are set, the model is built (its init depends
only on the seed and parameter names), gradient buffers and the optimizer wrap it, the
checkpoint (if ``--load``) restores weights, optimizer, schedule and RNG states, and only
then are the data iterators created, at the restored number of consumed samples. Creating
a DataLoader iterator draws from the global torch RNG, so that happens under a forked RNG.

``model_provider(cfg, ps) -> nn.Module`` and ``datasets_provider(cfg, tokenizer) ->
(train, valid, test)`` replace the GPT model and the Megatron datasets (tests use them).
"""

from __future__ import annotations

import copy
import logging
import random
import secrets
import time
from collections.abc import Callable

import numpy as np
import torch

from megalite.checkpoint import LoadOptions, load_checkpoint
from megalite.checkpoint.files import read_metadata
from megalite.checkpoint.lock import acquire_save_lock
from megalite.config import ConfigError, MegaliteConfig
from megalite.config.layout import resolve_layout
from megalite.hardware import peak_flops_per_rank, table_peak
from megalite.optim.build import build_grads_and_optimizer
from megalite.optim.lr_schedule import LRScheduler
from megalite.optim.memory import rank_memory
from megalite.parallel.collectives import broadcast_object_list
from megalite.parallel.random import stage_seed
from megalite.parallel.state import ParallelState
from megalite.pipeline.layout import model_chunks
from megalite.training.components import WANDB_RUN_ID, TrainingComponents, TrainState
from megalite.training.fp8 import check_fp8_available
from megalite.training.metrics import MetricsLogger, arguments_block
from megalite.training.preflight import check_output_dirs, preflight
from megalite.training.throughput import count_layer_params
from megalite.training.timers import Timers


def set_seeds(seed: int, ps: ParallelState) -> None:
    """python / numpy / torch seeds; pipeline stages differ (``parallel.random.stage_seed``).
    ``torch.manual_seed`` seeds every device's generator too (CUDA's lazily, so a CPU run
    never touches CUDA)."""
    seed = stage_seed(seed, ps)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_model_provider(cfg: MegaliteConfig, ps: ParallelState) -> torch.nn.Module:
    """The GPT model of this rank: one GPTModel, or with pipeline parallelism a ModuleList
    of this rank's chunks (``megalite.pipeline.layout``: global layer ranges, embedding on
    the first chunk of the first stage, output layer on the last chunk of the last)."""
    from megalite.models.gpt import GPTModel
    from megalite.parallel.random import RNGTracker

    p = cfg.parallel
    if ps.pp.size == 1:
        return GPTModel(cfg.model, ps, sequence_parallel=p.sequence_parallel,
                        seed=cfg.train.seed)
    ranges = resolve_layout(cfg, ps.world_size).stage_chunks[ps.pp.rank]
    rng = RNGTracker.from_state(ps, cfg.train.seed)  # one dropout stream for all chunks
    return torch.nn.ModuleList(
        GPTModel(cfg.model, ps, sequence_parallel=p.sequence_parallel, seed=cfg.train.seed,
                 pre_process=ps.is_pipeline_first_stage(c),
                 post_process=ps.is_pipeline_last_stage(c),
                 first_layer=first, num_layers=n, rng=rng)
        for c, (first, n) in enumerate(ranges))


def default_datasets_provider(cfg: MegaliteConfig, tokenizer) -> tuple:
    from megalite.config.batch_schedule import BatchSchedule
    from megalite.data import build_datasets

    t = cfg.train
    eval_runs = t.train_iters // t.eval_interval + 1
    schedule = BatchSchedule.from_config(t, cfg.model.seq_length)
    samples = (schedule.consumed_after(t.train_iters),
               eval_runs * t.eval_iters * t.global_batch_size,
               t.eval_iters * t.global_batch_size)
    return build_datasets(cfg.data, tokenizer, cfg.model.seq_length, t.seed,
                          num_samples=samples)


def _rng_tracker(model: torch.nn.Module):
    """The model's dropout RNG tracker (``model.rng``, an RNGTracker), if it has one."""
    model = model_chunks(model)[0]  # pipeline chunks share one tracker
    for name in ("rng", "rng_tracker"):
        tracker = getattr(model, name, None)
        if hasattr(tracker, "get_states") and hasattr(tracker, "set_states"):
            return tracker
    return None


def build_components(cfg: MegaliteConfig, ps: ParallelState, *,
                     model_provider: Callable | None = None,
                     datasets_provider: Callable | None = None,
                     peak_probe_seconds: float = 1.0) -> TrainingComponents:
    """Everything for :func:`megalite.training.loop.train`; loads ``--load`` if set.

    ``cfg`` must be validated for this world (``cfg.validate(world_size)``); it is copied,
    and the copy gets ``model.vocab_size`` from the tokenizer. With ``--save``, rank 0
    takes the directory's lock before any work (refusing a directory that holds another
    run's checkpoints this run does not load) and releases it if anything here fails.
    """
    if cfg.logging.logging_level is not None:   # Megatron's --logging-level: the root logger
        logging.getLogger().setLevel(cfg.logging.logging_level)
    check_fp8_available(cfg.model, ps.device)  # before any work: one clear sentence
    ck = cfg.checkpoint
    save_lock = None
    if ck.save:   # one job per --save, and no other run's checkpoints overwritten
        check_output_dirs(cfg, ps, ps.world_size - 1)
        save_lock = acquire_save_lock(ck.save, ps, load=ck.load,
                                      overwrite=ck.overwrite_checkpoints)
    try:
        return _build(cfg, ps, model_provider, datasets_provider, peak_probe_seconds,
                      save_lock)
    except BaseException:
        if save_lock is not None:
            save_lock.release()
        raise


def _build(cfg: MegaliteConfig, ps: ParallelState, model_provider: Callable | None,
           datasets_provider: Callable | None, peak_probe_seconds: float,
           save_lock) -> TrainingComponents:
    """:func:`build_components` once the ``--save`` lock (``save_lock``) is held."""
    start_time = time.time()
    cfg = copy.deepcopy(cfg)
    t = cfg.train
    layout = resolve_layout(cfg, ps.world_size)
    schedule = layout.batch_schedule
    if t.train_samples is not None:  # sample-based: the copy gets the number of iterations
        t.train_iters = schedule.iterations_for(t.train_samples)
        if t.train_iters == 0:
            raise ConfigError(f"--train-samples ({t.train_samples}) is less than one global "
                              f"batch ({schedule.global_batch_size(0)})")
    if t.train_iters is None:
        raise ConfigError("--train-iters or --train-samples is required")

    tokenizer = carried = None
    if datasets_provider is None:
        from megalite.checkpoint.tokenizer_dir import use_carried_tokenizer
        from megalite.data.tokenizers import build_tokenizer

        # no tokenizer named: the one the --load checkpoint carries (converted from HF)
        carried = use_carried_tokenizer(cfg.data, cfg.checkpoint.load)
        tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
        cfg.model.vocab_size = tokenizer.vocab_size
    layout = layout.with_vocab(cfg.model)
    set_seeds(t.seed, ps)
    model = (model_provider or default_model_provider)(cfg, ps)
    dtype = layout.dtype
    if any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    model.to(ps.device)
    if t.compile:  # after the casts and moves: compiled layers guard on dtype and device
        from megalite.models.compile import compile_model

        compile_model(model, mode=t.compile_mode)

    timers = Timers(cfg.logging.timing_log_level, ps.device)
    # DistributedOptimizer under --use-distributed-optimizer; buckets/overlap from cfg.parallel
    grads, optimizer = build_grads_and_optimizer(model, cfg, ps, timers)
    scheduler = LRScheduler.for_run(cfg, schedule)
    rng_tracker = _rng_tracker(model)
    log_rank = ps.world_size - 1
    preflight(cfg, model, ps, log_rank)  # outputs writable, disk space: before any work
    metrics = MetricsLogger(cfg.logging, t.train_iters, enabled=ps.rank == log_rank,
                            config=cfg.to_dict(), device=ps.device, world_size=ps.world_size)
    metrics.print(arguments_block(cfg.to_dict()))
    if carried is not None:
        metrics.print(f" tokenizer: {carried}, which the --load checkpoint carries "
                      f"(--tokenizer-type HuggingFaceTokenizer --tokenizer-model {carried})")
    if ps.rank == 0 and cfg.checkpoint.save and tokenizer is not None:
        from megalite.checkpoint.tokenizer_dir import carry_training_tokenizer

        # its checkpoints carry the run's Hugging Face tokenizer (save lock held)
        written = carry_training_tokenizer(cfg.data, cfg.checkpoint.save)
        if written is not None:
            print(f" copied the tokenizer {cfg.data.tokenizer_model} to {written}", flush=True)
    metrics.print(f" rank {ps.rank}: {rank_memory(model, grads, optimizer).describe()}")
    if ps.dp.rank == 0 and ps.cp.rank == 0:   # one line per (tp, pp) pair, as Megatron
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({ps.tp.rank}, {ps.pp.rank}): {sum(p.numel() for p in model.parameters())}",
              flush=True)

    state = TrainState()
    ck = cfg.checkpoint
    if ck.load:
        loaded = load_checkpoint(ck.load, model, optimizer, scheduler, ps,
                                 LoadOptions.from_config(ck), rng_tracker)
        if loaded is None:
            metrics.print(f" no checkpoint in {ck.load}; starting from scratch")
        else:
            state = TrainState(iteration=loaded.iteration,
                               consumed_train_samples=loaded.consumed_samples)
            metrics.print(f" loaded {loaded.path} (iteration {loaded.iteration}, "
                          f"{loaded.consumed_samples} samples consumed)")
            if not ck.finetune:   # no duplicate rows of the iterations that follow
                metrics.resume_at(loaded.iteration)
    wandb_id = _wandb_run_id(cfg, ps, metrics, loaded if ck.load else None)

    datasets = (datasets_provider or default_datasets_provider)(cfg, tokenizer)
    train_ds, valid_ds = datasets[0], datasets[1]
    test_ds = datasets[2] if len(datasets) > 2 else None
    if train_ds is None:
        raise ConfigError("no training data: check --data-path / --split / --mock-data")

    num_params = count_layer_params(model, ps)
    peak, peak_source = peak_flops_per_rank(ps.device, peak_probe_seconds)
    metrics.mfu_in_line = table_peak(ps.device)[0] is not None   # a datasheet's peak only
    per_step = (f"{layout.num_microbatches}" if not schedule.variable else
                "by batch-size schedule " + ", ".join(
                    f"{n} from {th} samples" for th, n in layout.microbatch_steps()))
    metrics.print(f" {ps.describe()} | transformer-layer parameters: {num_params:,} | "
                  f"precision: {dtype} | "
                  f"micro-batches per step: {per_step} | MFU peak: {peak_source}")
    return TrainingComponents(
        cfg=cfg, ps=ps, model=model, grads=grads, optimizer=optimizer, scheduler=scheduler,
        timers=timers, metrics=metrics, train_dataset=train_ds, valid_dataset=valid_ds,
        test_dataset=test_ds,
        layout=layout, peak_flops=peak, state=state, rng_tracker=rng_tracker,
        tokenizer=tokenizer, start_time=start_time, save_lock=save_lock, wandb_id=wandb_id)


def _wandb_run_id(cfg: MegaliteConfig, ps: ParallelState, metrics: MetricsLogger,
                  loaded) -> str | None:
    """With ``--wandb-project``: the wandb run id, the same on every rank (rank 0 writes it
    into each checkpoint's metadata.json, the logging rank logs to it). A run resumed from
    a checkpoint that holds one continues that run (``resume="allow"``); otherwise
    (a new run, ``--finetune``) rank 0 draws a new id. Collective when wandb is on."""
    if not cfg.logging.wandb_project:
        return None
    run_id = None
    if ps.rank == 0 and loaded is not None and not cfg.checkpoint.finetune:
        run_id = read_metadata(loaded.path).get(WANDB_RUN_ID)
    resume = run_id is not None
    if ps.rank == 0 and run_id is None:
        run_id = secrets.token_hex(8)
    run_id, resume = broadcast_object_list([run_id, resume])
    metrics.set_wandb_run(run_id, resume=resume)
    return run_id
