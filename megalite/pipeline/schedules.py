"""Pipeline schedules: each is a list of steps, run by one executor.

A step is ``("F", chunk, microbatch)``, ``("B", chunk, microbatch)`` or, in the
zero-bubble schedules (:mod:`megalite.pipeline.zero_bubble`), ``("W", chunk,
microbatch)``: there B computes the input gradient only and W the weight gradients it
deferred. A schedule function returns the ordered steps of one pipeline rank:

* :func:`one_f_one_b` -- warm-up forwards, then one forward / one backward, then the
  remaining backwards. With one stage it is plain gradient accumulation (F, B, F, B ...).
* :func:`interleaved_one_f_one_b` -- the same over ``v`` model chunks per rank, in
  Megatron-LM's order: groups of ``p`` micro-batches walk chunk 0, 1, ..., v-1 forward and
  chunk v-1, ..., 0 backward. Needs ``m % p == 0``.
* :func:`~megalite.pipeline.zero_bubble.zb_h1` -- ZB-H1: 1F1B with each backward split
  into B and W, the W steps delayed into the bubble.
* :func:`~megalite.pipeline.v_shape.zbv` and :func:`~megalite.pipeline.v_shape.dualpipev`
  -- ZB-V and DualPipeV: two chunks per rank placed in a V (rank 0 holds the first and
  the last layers), the split backward.
* :func:`forward_only` -- every forward, for evaluation.

:data:`PIPELINE_SCHEDULES` (``--pipeline-schedule``) names them, after torchtitan.

:func:`run_schedule` executes the steps: run the caller's forward on the input activation
(none on the first piece of the model) and send the output on (unless this is the last
piece); for a backward, back-propagate the output gradient (none on the last piece) and
send the input gradient back. In a schedule with W steps the forwards build deferrable
graphs, a B step back-propagates with the weight gradients deferred
(:mod:`megalite.parallel.weight_grad`) and its W step runs them. When each transfer is
posted -- and so the order of the messages between two ranks, which NCCL matches by order
alone -- comes from every rank's step list (:mod:`megalite.pipeline.plan`). Outputs
already sent are deallocated (their data replaced by a one-element tensor) so a rank holds
at most the 1F1B bound of activations, not GPipe's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megalite.config.batch_schedule import check_interleaved
from megalite.config.fields import require
from megalite.config.parallel import PIPELINE_SCHEDULES, check_pipeline_schedule, is_v_schedule
from megalite.parallel import paired_lanes, weight_grad
from megalite.pipeline.p2p import Incoming, PipeComm
from megalite.pipeline.plan import Step, pairs_of, plan_rounds
from megalite.pipeline.v_shape import dualpipev, v_forward_only, zbv
from megalite.pipeline.zero_bubble import zb_h1


def one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """Non-interleaved 1F1B steps of pipeline rank ``pp_rank``."""
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    steps: list[Step] = [("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", 0, warmup + i), ("B", 0, i)]
    steps += [("B", 0, i) for i in range(m - warmup, m)]
    return steps


def _interleaved_index(k: int, pp_size: int, vpp: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) of the interleaved schedule."""
    group, within = divmod(k, pp_size * vpp)
    chunk = within // pp_size
    if backward:
        chunk = vpp - 1 - chunk
    return chunk, group * pp_size + within % pp_size


def interleaved_one_f_one_b(pp_size: int, pp_rank: int, num_microbatches: int,
                            vpp: int) -> list[Step]:
    """Interleaved 1F1B steps of ``pp_rank`` over ``vpp`` chunks."""
    check_interleaved(num_microbatches, pp_size)
    total = num_microbatches * vpp
    if num_microbatches == pp_size:
        warmup = total
    else:
        warmup = min((pp_size - pp_rank - 1) * 2 + (vpp - 1) * pp_size, total)
    fwd = [("F", *_interleaved_index(k, pp_size, vpp, False)) for k in range(total)]
    bwd = [("B", *_interleaved_index(k, pp_size, vpp, True)) for k in range(total)]
    steps: list[Step] = fwd[:warmup]
    for i in range(total - warmup):
        steps += [fwd[warmup + i], bwd[i]]
    steps += bwd[total - warmup:]
    return steps


def forward_only(num_microbatches: int, vpp: int = 1, pp_size: int = 1) -> list[Step]:
    """Every forward step, in the order the training schedule would run them."""
    if vpp == 1:
        return [("F", 0, i) for i in range(num_microbatches)]
    return [("F", *_interleaved_index(k, pp_size, vpp, False))
            for k in range(num_microbatches * vpp)]


def all_forward_then_backward(num_microbatches: int) -> list[Step]:
    """GPipe's order (every forward, then every backward): the activation-memory baseline
    1F1B is measured against; not used for training."""
    return ([("F", 0, i) for i in range(num_microbatches)]
            + [("B", 0, i) for i in range(num_microbatches)])


def build_schedule(pp_size: int, pp_rank: int, num_microbatches: int, vpp: int = 1,
                   train: bool = True, schedule: str | None = None) -> list[Step]:
    """The steps of pipeline rank ``pp_rank`` under ``schedule`` (a name of
    :data:`PIPELINE_SCHEDULES`; default: 1F1B, or interleaved 1F1B when ``vpp > 1``), or
    every forward (``train=False``)."""
    require(schedule is None or schedule in PIPELINE_SCHEDULES,
            f"unknown pipeline schedule {schedule!r}; choose from "
            f"{', '.join(PIPELINE_SCHEDULES)}")
    if not train:
        if is_v_schedule(schedule):
            return v_forward_only(pp_size, pp_rank, num_microbatches)
        return forward_only(num_microbatches, vpp, pp_size)
    schedule = check_pipeline_schedule(schedule, vpp)
    if schedule == "zbv":
        return zbv(pp_size, pp_rank, num_microbatches)
    if schedule == "dualpipev":
        return dualpipev(pp_size, pp_rank, num_microbatches)
    if schedule == "interleaved_1f1b":
        return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, vpp)
    if schedule == "zb_h1":
        return zb_h1(pp_size, pp_rank, num_microbatches)
    return one_f_one_b(pp_size, pp_rank, num_microbatches)


def build_schedules(pp_size: int, num_microbatches: int, vpp: int = 1,
                    train: bool = True, schedule: str | None = None) -> list[list[Step]]:
    """The steps of every pipeline rank (index: pipeline rank), for :func:`run_schedule`."""
    return [build_schedule(pp_size, r, num_microbatches, vpp, train, schedule)
            for r in range(pp_size)]


def layout_schedules(layout, num_microbatches: int | None = None,
                     train: bool = True) -> list[list[Step]]:
    """Every pipeline rank's steps for a resolved ``layout`` (``megalite.config.layout``)
    at ``num_microbatches`` per step (default: the layout's, of the final global batch),
    under its ``pipeline_schedule``."""
    return build_schedules(layout.pp, num_microbatches or layout.num_microbatches,
                           layout.vpp, train, layout.pipeline_schedule)


@functools.lru_cache(maxsize=16)
def _plan(rank_steps: tuple[tuple[Step, ...], ...], vpp: int, v_shape: bool,
          paired: bool = False):
    """plan_rounds, kept for the next global batch (the same steps every iteration);
    ``paired``: with the (backward, forward) pairs of :func:`pairs_of`."""
    steps = [list(s) for s in rank_steps]
    return plan_rounds(steps, vpp, v_shape, pairs_of(steps, vpp, v_shape) if paired else None)


@dataclass
class ScheduleStats:
    """Per-rank timings of one schedule run (seconds) and peak live activations."""

    busy: float = 0.0
    waiting: float = 0.0
    peak_live_outputs: int = 0
    peak_activation_bytes: int = 0
    peak_pending_weight_grads: int = 0   # forwards whose W (else: B) has not run yet
    pairs: int = 0   # backwards run paired with the next forward (the all-to-all overlap)
    events: list = field(default_factory=list)


def _deallocate(t: torch.Tensor) -> None:
    """Free the data of an output already sent on; its autograd graph stays."""
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Back-propagate from ``output`` whose data may have been deallocated.

    ``torch.autograd.backward`` checks ``grad``'s shape against ``output``'s, which no
    longer holds after deallocation; the engine itself only needs the graph.
    """
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True)


def run_schedule(rank_steps: list[list[Step]], *, forward_step: Callable, ps, vpp: int,
                 comm: PipeComm | None, train: bool = True,
                 deallocate: bool = True, stats: ScheduleStats | None = None,
                 v_shape: bool = False, pair_backward_forward: bool = False,
                 delay_wgrad: bool = False) -> None:
    """Execute this rank's steps, ``rank_steps[ps.pp.rank]``.

    rank_steps: the steps of every pipeline rank (index: pipeline rank); together they fix
    when each transfer is posted (:func:`megalite.pipeline.plan.plan_rounds`).
    forward_step(chunk, microbatch, input_tensor) -> output: ``input_tensor`` is None on
    the first piece of the model (chunk 0 of pipeline rank 0); the output of the last
    piece is the scalar loss to back-propagate (already scaled by the caller), of any
    other piece the activation ``[s, b, h]`` to send on.
    comm: the :class:`PipeComm` of this rank (None when pp == 1).
    v_shape: the pieces sit in ZB-V's V (:mod:`megalite.pipeline.plan`): the last rank's
    chunk 0 hands its output to its own chunk 1 (a detached copy that collects the
    gradient, as a received activation does) and chunk 1's input gradient back to chunk 0.
    pair_backward_forward: run each backward that the next forward follows as a pair of
    :mod:`megalite.parallel.paired_lanes` (``--overlap-moe-expert-parallel-comm``): the two
    micro-batches take turns at every expert all-to-all, each exchange running while the
    other computes. The plan treats the pair as one unit (:func:`pairs_of`): it waits for
    both inputs and sends both outputs after it, so every backward of the steady state
    pairs, on every stage. delay_wgrad (``--delay-wgrad-compute``): the paired backward defers its
    weight gradients (:mod:`megalite.parallel.weight_grad`), run right after the pair.
    """
    rank = ps.pp.rank
    arrived: dict[Step, Incoming] = {}  # posted receives of later steps' inputs
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    # split backward (W steps in the schedule): forwards build deferrable graphs, a B step
    # queues its weight gradients here and its W step runs them
    split = train and any(s[0] == "W" for s in rank_steps[rank])
    splittable = weight_grad.splittable if split else contextlib.nullcontext
    deferred: dict[tuple[int, int], list] = {}
    kept: dict[Step, torch.Tensor] = {}   # outputs for this rank's own later steps (the V)
    # --delay-wgrad-compute: every forward builds graphs whose weight gradients can wait,
    # switched on once around the whole run (the switch is module state that both lanes
    # of a pair would otherwise set and reset in each other's middle)
    delay_wgrad = delay_wgrad and pair_backward_forward and train and not split
    outer = weight_grad.splittable() if delay_wgrad else contextlib.nullcontext()

    def run_forward(chunk, mb, received):
        with torch.set_grad_enabled(train), splittable():
            y = forward_step(chunk, mb, received)
        if train:
            inputs[(chunk, mb)], outputs[(chunk, mb)] = received, y
        return ("F", y)

    def run_backward(chunk, mb, received, defer=False):
        x, y = inputs.pop((chunk, mb)), outputs.pop((chunk, mb))
        if split or defer:   # recomputed forwards inside the backward defer too
            with splittable(), weight_grad.deferring() as queue:
                _backward(y, received)
            deferred[(chunk, mb)] = queue
        else:
            _backward(y, received)
        return ("B", x.grad) if x is not None else None

    paired = pair_backward_forward and train and not v_shape and not split
    rounds = _plan(tuple(map(tuple, rank_steps)), vpp, v_shape, paired)[rank]

    def transfer(rnd, out: dict) -> None:
        """Post ``rnd``'s batch: the outputs it sends (``out``: kind -> ``(kind, tensor)``
        of the steps run), a pair's forward first, and its receives."""
        if rnd.sends or rnd.pair_sends or rnd.recvs:
            sends = rnd.outputs()
            got = comm.exchange([out[step[0]] for step, _ in sends],
                                [s[0] for s in rnd.recvs], [dst for _, dst in sends],
                                rnd.recv_from)
            arrived.update(zip(rnd.recvs, got))
            if deallocate and train and any(step[0] == "F" for step, _ in sends):
                _deallocate(out["F"][1])
            comm.reap()

    def record(rnd, t0: float, waited0: float) -> None:
        if stats is None:
            return
        waited = (comm.wait_seconds if comm else 0.0) - waited0
        elapsed = time.perf_counter() - t0
        stats.waiting += waited
        stats.busy += elapsed - waited
        for step in (rnd.step, rnd.pair):   # a pair's two steps share one span
            if step is not None:
                stats.events.append((*step, t0, elapsed, waited))
        stats.peak_live_outputs = max(stats.peak_live_outputs, len(outputs))
        stats.peak_pending_weight_grads = max(stats.peak_pending_weight_grads,
                                              len(outputs) + len(deferred))
        live = sum(x.numel() * x.element_size() for x in inputs.values() if x is not None)
        stats.peak_activation_bytes = max(stats.peak_activation_bytes, live)

    def take(step):
        incoming = arrived.pop(step, None)  # None: first / last piece
        return comm.take(incoming) if incoming is not None else None

    with outer:
        for rnd in rounds:
            t0 = time.perf_counter()
            waited0 = comm.wait_seconds if comm else 0.0
            send = None
            if rnd.step is not None:
                kind, chunk, mb = rnd.step
                received = take(rnd.step)
                if rnd.step in kept:
                    received = kept.pop(rnd.step)
                if rnd.pair is not None:   # this backward and the next forward take turns
                    f_step = rnd.pair
                    f_received = take(f_step)
                    got = {}
                    paired_lanes.run_paired(
                        lambda: got.setdefault("B", run_backward(chunk, mb, received,
                                                                 delay_wgrad)),
                        lambda: got.setdefault("F", run_forward(*f_step[1:], f_received)))
                    if delay_wgrad:
                        weight_grad.apply(deferred.pop((chunk, mb)))
                    transfer(rnd, got)
                    record(rnd, t0, waited0)
                    if stats is not None:
                        stats.pairs += 1
                    continue
                if kind == "F":
                    send = run_forward(chunk, mb, received)
                elif kind == "B":
                    send = run_backward(chunk, mb, received)
                else:
                    weight_grad.apply(deferred.pop((chunk, mb)))
                if rnd.local:   # the turn of the V: chunk 0 <-> chunk 1 on this rank
                    kind_, tensor = send
                    if kind_ == "F":
                        # a copy, as a transfer gives: the output's storage may be a
                        # buffer handed out again (reused_buffer) or freed below
                        kept[("F", 1, mb)] = tensor.detach().clone().requires_grad_(train)
                        if deallocate and train:
                            _deallocate(tensor)
                    else:
                        kept[("B", 0, mb)] = tensor
            transfer(rnd, {send[0]: send} if send else {})
            record(rnd, t0, waited0)
    if comm is not None:
        comm.wait_all()
