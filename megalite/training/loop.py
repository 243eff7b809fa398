"""The training loop: train_step -> (evaluate) -> log -> (save) -> (exit?), repeated.

Loss normalization makes ``lm_loss`` the token mean over the whole global batch for any
data-parallel size and micro-batch split: a step first counts the valid (``loss_mask``)
tokens of all its micro-batches on all data-parallel ranks (SUM over ``ps.dp_cp``), then
back-propagates each micro-batch's *summed* masked loss divided by that global count, and
the data-parallel reduction SUMS gradients. The gradient is then exactly that of the
global-batch mean loss, whatever the layout. (``--per-microbatch-loss`` selects
Megatron's default per-micro-batch mean instead: ``forward_backward.loss_divisors``.)

Batch size: the step after ``consumed`` samples has ``schedule.global_batch_size(consumed)``
samples (``megalite.config.batch_schedule``: constant, ``--rampup-batch-size`` or
``--step-batch-size-schedule``), i.e. that many / (micro x dp) micro-batches per rank, drawn
from one data stream; the LR schedule advances by the step's samples when it counts
samples. ``--train-samples`` becomes a number of iterations at build time.
Around the steps: ``--manual-gc`` (``manual_gc.ManualGC``), ``--profile``
(``profiling.StepProfiler``) and, on CUDA, the device-memory line and peak
(``memory_log.MemoryReporter``).

A NaN/inf loss (``--check-for-nan-in-loss-and-grad``, on by default) raises
:class:`NonFiniteLossError` naming the iteration before the optimizer or a checkpoint sees
it. Non-finite gradients skip the step under fp16 (loss scaling backs off); otherwise they
raise too. fp16 loss scaling that cannot learn (every step skipped, or every gradient
zero, for a window; or every step of a shorter run skipped) raises
:class:`~megalite.training.health.LossScaleError` before that iteration's checkpoint
(``megalite.training.health``). A run without a validation set says so once at start.
A run that finishes evaluates once more, as Megatron does: the validation set (unless its
last iteration just did) and the test set (where ``--split`` gives one), printed as
``validation loss at the end of training | ...`` and ``test loss at the end of training``.
With ``--moe-router-enable-expert-bias`` every step ends with the bias update over the
global batch's expert loads (:mod:`megalite.moe.expert_bias`), after the optimizer.
With ``--qk-clip`` / ``--log-max-attention-logit`` the attention layers' per-head maximum
logits of the step are reduced before the optimizer (:mod:`megalite.optim.qk_clip`), the
step scales the clipped heads' query/key rows of its masters, and the largest logit is
logged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megalite.checkpoint import CheckpointSaver, save_checkpoint
from megalite.errors import NumericalError
from megalite.moe.expert_bias import load_metrics, update_expert_bias
from megalite.optim.grad_stats import num_zeros, params_norm
from megalite.optim.qk_clip import (
    clip_factors,
    max_attention_logit,
    reset_max_logits,
    step_max_logits,
)
from megalite.parallel.collectives import ReduceOp, all_reduce, all_reduce_scalar
from megalite.parallel.cp_chunks import slice_batch, with_document_ids
from megalite.pipeline.layout import model_chunks
from megalite.transformer.mtp import mtp_depths, roll_for_mtp
from megalite.training.components import TrainState
from megalite.training.forward_backward import (MTPLosses, RouterLosses, forward_backward,
                                                loss_divisors, mtp_loss_divisors)
from megalite.training.fp8 import finish_fp8_step
from megalite.training.health import LossScaleError, LossScaleWatchdog  # noqa: F401 (re-export)
from megalite.training.manual_gc import ManualGC
from megalite.training.memory_log import MemoryReporter
from megalite.training.metrics import IterationMetrics
from megalite.training.profiling import StepProfiler
from megalite.training.rerun import ResultValidator
from megalite.training.signals import SignalHandler, exit_signals
from megalite.training.straggler import StragglerDetector
from megalite.training.straggler import line as straggler_line
from megalite.training.timers import format_ms

if TYPE_CHECKING:
    from megalite.training.components import TrainingComponents

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


class NonFiniteLossError(NumericalError):
    """The loss or the gradients became NaN/inf; no update or checkpoint was made."""


@dataclass
class StepResult:
    lm_loss: float
    lr: float
    updated: bool
    grad_norm: float | None
    loss_scale: float
    # moe_aux_loss / moe_z_loss means; with the expert bias also the load ratios
    # (moe_load_max_ratio, moe_load_min_ratio, expert_load: megalite.moe.expert_bias);
    # with --mtp-num-layers N also mtp_1_loss .. mtp_N_loss
    moe_losses: dict = field(default_factory=dict)
    faulty_ranks: list | None = None   # a transient fault: ranks whose re-run differed
    num_zeros: int | None = None        # --log-num-zeros-in-grad (None: skipped step)
    params_norm: float | None = None    # --log-params-norm, after the update
    max_attention_logit: float | None = None   # --log-max-attention-logit / --qk-clip


@dataclass
class TrainResult:
    """How :func:`train` ended: ``exit_reason`` is ``finished``, ``signal``,
    ``exit-interval`` or ``exit-duration``; ``losses`` maps iteration -> lm_loss,
    ``moe_losses`` iteration -> {moe_aux_loss, moe_z_loss} (MoE models);
    ``final_losses`` the end-of-training evaluation's ``validation`` / ``test`` losses."""

    iteration: int
    exit_reason: str
    losses: dict = field(default_factory=dict)
    valid_losses: dict = field(default_factory=dict)
    moe_losses: dict = field(default_factory=dict)
    batch_sizes: dict = field(default_factory=dict)     # iteration -> global batch size
    final_losses: dict = field(default_factory=dict)    # end of training: validation, test
    gc_collected_at: list = field(default_factory=list)  # --manual-gc collections


# -- one step ---------------------------------------------------------------------------
def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS if k in batch}


def _local_batch(batch: dict, ps, mtp: int = 0) -> dict:
    """A micro-batch on this rank's device; under context parallelism only this cp rank's
    load-balanced chunks of it (tokens, labels, loss mask, position ids:
    ``megalite.parallel.cp_chunks.slice_batch``). A document mask
    (``--reset-attention-mask``) travels as per-token ``document_ids`` of the whole
    sequence. With ``mtp`` prediction depths the tokens, labels and loss mask rolled left
    by 1..mtp are added first, from the whole sequence (``transformer.mtp.roll_for_mtp``)."""
    batch = roll_for_mtp(_to_device(with_document_ids(batch), ps.device), mtp)
    return slice_batch(batch, ps.cp.size, ps.cp.rank)


def count_tokens(batches: list[dict], group) -> torch.Tensor:
    """Valid tokens of the global batch: this rank's loss_mask sum, SUM over ``group``
    (``ps.dp_cp``). fp64 scalar, at least 1."""
    local = sum(b["loss_mask"].double().sum() for b in batches)
    total = all_reduce(torch.as_tensor(local, dtype=torch.float64).reshape(1), group)
    return total.clamp_min(1.0)


def _forward_backward(c: TrainingComponents, batches: list[dict], tokens: torch.Tensor,
                      divisors, iteration: int, validator: ResultValidator | None,
                      attempt: int = 0):
    """Zero the gradients, run the schedule; (local loss sum ``[1]`` fp64, global lm_loss,
    router losses). ``attempt`` 1 is a validation re-run."""
    c.grads.zero_grad(num_microbatches=len(batches))  # each chunk's m-th grad is final
    reset_max_logits(c.model)   # --qk-clip: this run's logits only
    router = RouterLosses(c.ps.device) if c.cfg.model.num_experts is not None else None
    depths = mtp_depths(c.cfg.model)
    mtp = MTPLosses(depths, c.ps.device) if depths else None
    mtp_divisors = (mtp_loss_divisors(batches, c.ps.dp.size)   # as Megatron's default
                    if depths and c.cfg.train.per_microbatch_loss else None)
    with c.timers("forward-backward", log_level=1):
        loss_sum = forward_backward(c, batches, divisors, loss_scale=c.optimizer.scale_loss,
                                    router_losses=router, mtp_losses=mtp,
                                    mtp_divisors=mtp_divisors)
    if validator is not None:
        loss_sum = validator.corrupt(loss_sum, iteration, attempt, c.ps)
    lm_loss = float((all_reduce(loss_sum.clone(), c.ps.dp_cp) / tokens).item())
    return loss_sum, lm_loss, (router, mtp)


def train_step(c: TrainingComponents, batches: list[dict], iteration: int,
               validator: ResultValidator | None = None,
               samples: tuple[int, int] = (0, 0)) -> StepResult:
    """One optimizer step over this rank's ``batches`` (its micro-batches of the global
    batch). ``iteration`` (1-based) and ``samples`` (the global batch's first and end
    sample) name the step in errors; ``validator`` re-runs a suspicious step
    (``--rerun-mode validate_results``, :mod:`megalite.training.rerun`)."""
    ps = c.ps
    c.model.train()
    batches = [_local_batch(b, ps, mtp_depths(c.cfg.model)) for b in batches]
    tokens = count_tokens(batches, ps.dp_cp)
    divisors = loss_divisors(batches, tokens, c.cfg.train.per_microbatch_loss, ps.dp.size)
    validating = validator is not None and validator.enabled
    snapshot = validator.snapshot(c) if validating else None
    loss_sum, lm_loss, router = _forward_backward(c, batches, tokens, divisors, iteration,
                                                  validator)
    clip: dict = {}   # --qk-clip: the step's row factors (set below, before the step)

    def rerun_and_judge(reason: str, first: torch.Tensor, step_again: bool = False):
        """The same step again from the same state (the parameters are unchanged), judged
        against the first run's local loss sum ``first`` (``[1]`` fp64); judge() raises if
        the fault came back. ``step_again``: the re-run's gradients go through the
        optimizer too, and NaN/inf in them again is the fault coming back. Returns
        ((loss sum, lm_loss, router losses), faulty ranks, the optimizer's outcome or None)."""
        validator.restore(c, snapshot)
        result = _forward_backward(c, batches, tokens, divisors, iteration, validator,
                                   attempt=1)
        outcome = reproduced = None
        if step_again:
            c.grads.finish_grad_sync()
            with c.timers("optimizer", log_level=1):
                outcome = (c.optimizer.step(row_scales=clip) if clip
                           else c.optimizer.step())
            reproduced = outcome.found_inf
        faulty = validator.judge(reason, iteration, first, result[0], ps, samples,
                                 reproduced=reproduced)
        return result, faulty, outcome

    reason = validator.decide(lm_loss, iteration, ps) if validating else None
    faulty_ranks = None
    if reason is not None:
        c.grads.finish_grad_sync()   # let this run's reductions end before the re-run
        (loss_sum, lm_loss, router), faulty_ranks, _ = rerun_and_judge(reason, loss_sum)
    check = c.cfg.train.check_for_nan_in_loss_and_grad
    if check and not math.isfinite(lm_loss):
        raise NonFiniteLossError(f"the loss is {lm_loss} at iteration {iteration} "
                                 f"(rank {ps.rank}); stopping without updating the model "
                                 "or writing a checkpoint")
    c.grads.finish_grad_sync()
    finish_fp8_step(model_chunks(c.model), ps)   # delayed scaling: this step's amaxes
    lcfg, mcfg = c.cfg.logging, c.cfg.model
    top_logit = None
    if mcfg.qk_clip or mcfg.log_max_attention_logit:   # collectives (dp_cp, world)
        maxima = step_max_logits(c.model, ps)
        top_logit = max_attention_logit(maxima, ps)
        if mcfg.qk_clip:
            clip = clip_factors(c.model, maxima, mcfg.qk_clip_threshold, mcfg.qk_clip_alpha)
    with c.timers("optimizer", log_level=1):
        lr = c.scheduler.apply(c.optimizer)
        zeros = (num_zeros(c.optimizer.owned_grads(), ps)   # collective (world)
                 if lcfg.log_num_zeros_in_grad else None)
        outcome = c.optimizer.step(row_scales=clip) if clip else c.optimizer.step()
    if outcome.found_inf and check and not c.optimizer.fp16 and validating \
            and reason is None:   # NaN/inf gradients: nothing was updated; re-run the same way
        reason = validator.suspicious(lm_loss, iteration, found_inf=True)
        (loss_sum, lm_loss, router), faulty_ranks, outcome = rerun_and_judge(
            reason, loss_sum, step_again=True)
    router, mtp = router
    moe_losses = router.means() if router is not None else {}  # collective (world)
    if c.cfg.model.moe_router_enable_expert_bias:   # once per step, collective (world)
        moe_losses.update(load_metrics(update_expert_bias(   # MTP layers numbered after
            model_chunks(c.model), ps, c.cfg.model.moe_router_bias_update_rate,
            c.cfg.model.num_layers + mtp_depths(c.cfg.model))))
    if mtp is not None:
        moe_losses.update(mtp.means())   # collective (world)
    if reason is not None and faulty_ranks is None:   # a requested validation passed
        c.metrics.print(f" iteration {iteration}: validated: the re-run reproduced the step "
                        f"bit for bit")
    elif faulty_ranks is not None:
        c.metrics.print(f" iteration {iteration}: transient fault ({reason}); the re-run "
                        f"differs on rank(s) {faulty_ranks or 'none (only the check)'}; "
                        f"continuing with the re-run's result (loss {lm_loss:.6g})")
    if outcome.found_inf and check and not c.optimizer.fp16:
        raise NonFiniteLossError(f"the gradients hold NaN/inf at iteration {iteration} "
                                 f"(loss {lm_loss:.6g}); stopping without updating the model "
                                 "or writing a checkpoint")
    if validating:
        validator.accept(lm_loss)
    if outcome.updated:
        c.scheduler.advance(len(batches) * c.cfg.train.micro_batch_size * ps.dp.size)
    pnorm = (params_norm(c.optimizer.owned_params(), ps)   # collective (world)
             if lcfg.log_params_norm else None)
    return StepResult(lm_loss=lm_loss, lr=lr, updated=outcome.updated,
                      grad_norm=outcome.grad_norm, loss_scale=c.optimizer.loss_scale,
                      moe_losses=moe_losses, faulty_ranks=faulty_ranks,
                      num_zeros=zeros if outcome.updated else None, params_norm=pnorm,
                      max_attention_logit=top_logit)


@torch.no_grad()
def evaluate(c: TrainingComponents, data_iterator: Iterator, num_steps: int) -> float:
    """Mean lm loss over ``num_steps`` global batches of ``data_iterator`` (token mean over
    all of them, SUM over ``ps.dp_cp``)."""
    c.grads.regather_stale()   # --fp8-param-gather: the weights in their dtype
    c.model.eval()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=c.ps.device)
    tokens = torch.zeros(1, dtype=torch.float64, device=c.ps.device)
    one = torch.ones((), dtype=torch.float64, device=c.ps.device)
    with c.timers("evaluate", log_level=0):
        for _ in range(num_steps):
            batches = [_local_batch(next(data_iterator), c.ps)
                       for _ in range(c.num_microbatches)]
            loss_sum += forward_backward(c, batches, one, train=False)
            tokens += sum(b["loss_mask"].double().sum() for b in batches)
    c.model.train()
    all_reduce(loss_sum, c.ps.dp_cp)
    all_reduce(tokens, c.ps.dp_cp)
    return float((loss_sum / tokens.clamp_min(1.0)).item())


# -- the loop ---------------------------------------------------------------------------
def save(c: TrainingComponents, state: TrainState, saver: CheckpointSaver) -> None:
    """Checkpoint ``state`` to ``--save`` (collective); with ``--async-save`` the write
    continues in the background and is published at the next save or ``saver.close()``."""
    ck = c.cfg.checkpoint
    # --overlap-param-gather leaves parameters stale until the next forward: finish the
    # all-gather so the saved weights are the updated ones (with or without optimizer state)
    c.grads.finish_param_sync()
    with c.timers("save-checkpoint", log_level=0):
        path = save_checkpoint(ck.save, state.iteration, c.model, c.optimizer, c.scheduler,
                               c.ps, c.cfg.to_dict(), state.consumed_train_samples,
                               save_optim=not ck.no_save_optim, save_rng=not ck.no_save_rng,
                               rng_tracker=c.rng_tracker, saver=saver,
                               extra_meta=c.checkpoint_meta())
    if c.ps.rank == 0:
        how = "started saving (async)" if ck.async_save else "saved"
        print(f" {how} checkpoint at iteration {state.iteration} to {path}", flush=True)


def _exit_reason(c: TrainingComponents, state: TrainState,
                 signals: SignalHandler) -> str | None:
    """Why to stop after this iteration (every rank gets the same answer), or None.
    ``--exit-duration-in-mins`` counts from the start of ``build_components``."""
    t = c.cfg.train
    if signals.any_rank_received(c.ps.device):
        return "signal"
    if t.exit_duration_in_mins is not None:
        minutes = all_reduce_scalar((time.time() - c.start_time) / 60.0, None,
                                    ReduceOp.MAX, c.ps.device)
        if minutes > t.exit_duration_in_mins:
            return "exit-duration"
    if t.exit_interval is not None and state.iteration % t.exit_interval == 0:
        return "exit-interval"
    return None


def train(c: TrainingComponents) -> TrainResult:
    """Run from ``c.state`` to ``--train-iters`` (or an exit condition); see module doc."""
    cfg, state, metrics = c.cfg, c.state, c.metrics
    t, ck = cfg.train, cfg.checkpoint
    seq, schedule = cfg.model.seq_length, c.schedule
    result = TrainResult(iteration=state.iteration, exit_reason="finished")
    if state.iteration >= t.train_iters:
        metrics.print(f" already trained for {state.iteration} iterations "
                      f"(--train-iters {t.train_iters}); nothing to do")
        return result
    train_iter = c.train_iterator(state.consumed_train_samples)
    valid_iter = c.valid_iterator(state.iteration)
    if valid_iter is None and t.eval_iters > 0:
        metrics.print(" no validation set (--split or --valid-data-path gives it no data): "
                      "no validation loss will be computed; --eval-interval and "
                      "--eval-iters have no effect")
    last_saved = state.iteration if ck.load else None
    watchdog = LossScaleWatchdog.from_config(cfg)
    validator = ResultValidator.from_config(t)   # --rerun-mode validate_results
    memory = MemoryReporter(c.ps, cfg.logging.log_interval)  # CUDA memory line + peak
    stragglers = StragglerDetector.from_config(cfg, c.timers)  # --log-straggler
    saver = CheckpointSaver(c.ps, async_save=bool(ck.save) and ck.async_save,
                            verify=ck.ckpt_verify)
    with SignalHandler(enabled=t.exit_signal_handler,
                       sigs=exit_signals(t.exit_signal)) as signals, \
            ManualGC.from_config(t) as manual_gc, \
            StepProfiler.from_config(cfg, c.ps.rank, c.ps.device,
                                     c.grads.wait_param_sync) as profiler:
        while state.iteration < t.train_iters:
            gbs = schedule.global_batch_size(state.consumed_train_samples)
            tick = time.perf_counter()
            with profiler.iteration(state.iteration):
                with c.timers("batch-generator", log_level=1):
                    batches = [next(train_iter) for _ in range(
                        c.layout.microbatches_at(state.consumed_train_samples))]
                step = train_step(c, batches, state.iteration + 1, validator,
                                  (state.consumed_train_samples,
                                   state.consumed_train_samples + gbs))
            elapsed = time.perf_counter() - tick
            state.iteration += 1
            state.consumed_train_samples += gbs
            state.skipped_iters += int(not step.updated)
            result.losses[state.iteration] = step.lm_loss
            result.batch_sizes[state.iteration] = gbs
            if step.moe_losses:
                result.moe_losses[state.iteration] = step.moe_losses
            manual_gc.after_iteration(state.iteration)

            extra = dict(step.moe_losses)  # MoE router losses, if any
            if step.faulty_ranks is not None:
                extra["transient_fault_ranks"] = step.faulty_ranks
            extra.update(memory.after_iteration(state.iteration))  # {} off CUDA
            if schedule.variable:
                extra["global_batch_size"] = gbs
            if (valid_iter is not None and t.eval_iters > 0
                    and state.iteration % t.eval_interval == 0):
                manual_gc.around_eval()
                valid_loss = evaluate(c, valid_iter, t.eval_iters)
                manual_gc.around_eval()
                result.valid_losses[state.iteration] = valid_loss
                extra.update(validation_loss=valid_loss,
                             validation_ppl=math.exp(min(20.0, valid_loss)))
            tokens_per_sec = gbs * seq / elapsed
            flops = c.flops_per_iteration * (gbs / schedule.final_batch_size)
            mfu = flops / (elapsed * c.peak_flops * c.ps.world_size)
            straggler = stragglers.after_iteration(state.iteration, elapsed)  # collective
            if straggler is not None:
                extra["straggler"] = straggler
            metrics.record(IterationMetrics(
                iteration=state.iteration, lm_loss=step.lm_loss, grad_norm=step.grad_norm,
                lr=step.lr, loss_scale=step.loss_scale, skipped=not step.updated,
                tokens_per_sec=tokens_per_sec, mfu=mfu, elapsed_s=elapsed,
                consumed_samples=state.consumed_train_samples, global_batch_size=gbs,
                tflops_per_gpu=flops / (elapsed * c.ps.world_size) / 1e12,
                num_zeros=step.num_zeros, params_norm=step.params_norm,
                max_attention_logit=step.max_attention_logit),
                extra=extra or None)
            if "validation_loss" in extra:
                metrics.record_eval(state.iteration, extra["validation_loss"])
            if straggler is not None:
                metrics.print(straggler_line(state.iteration, straggler))
            if state.iteration % cfg.logging.log_interval == 0 and (
                    cfg.logging.timing_log_level > 0 or cfg.logging.log_timers_to_tensorboard):
                times = c.timers.ms_per(normalizer=cfg.logging.log_interval)
                if cfg.logging.timing_log_level > 0:
                    metrics.print(" timers (ms/iter) | " + format_ms(times))
                metrics.record_timers(state.iteration, times)
            watchdog.after_step(state.iteration, step.updated, step.grad_norm,
                                step.loss_scale, step.lm_loss)

            if ck.save and ck.save_interval and state.iteration % ck.save_interval == 0:
                save(c, state, saver)
                last_saved = state.iteration
            reason = _exit_reason(c, state, signals)
            if reason is not None:
                result.exit_reason = reason
                metrics.print(f" exiting at iteration {state.iteration}: {reason}")
                break
        watchdog.at_end(state.iteration)   # every step of a short run skipped: exit 5
        # inside the handler: a second SIGTERM (a scheduler and torchrun both send one)
        # must not kill a rank in the middle of its exit save
        if ck.save and last_saved != state.iteration and state.iteration > 0:
            save(c, state, saver)
        saver.close()  # waits for an async save and publishes it
        if result.exit_reason == "finished" and t.eval_iters > 0:
            iterators = {"validation": None if state.iteration in result.valid_losses
                         else valid_iter, "test": c.test_iterator()}
            for label, iterator in iterators.items():   # Megatron's do_valid / do_test
                if iterator is not None:
                    manual_gc.around_eval()
                    loss = evaluate(c, iterator, t.eval_iters)
                    manual_gc.around_eval()
                    result.final_losses[label] = loss
                    metrics.record_eval(state.iteration, loss, label, "the end of training")
        result.gc_collected_at = list(manual_gc.collected_at)
    result.iteration = state.iteration
    return result
