"""Pipeline schedules: each is a list of steps, run by one executor.

A step is ``("F", chunk, microbatch)`` or ``("B", chunk, microbatch)``. A schedule
function returns the ordered steps of one pipeline rank:

* :func:`one_f_one_b` -- warm-up forwards, then one forward / one backward, then the
  remaining backwards. With one stage it is plain gradient accumulation (F, B, F, B ...).
* :func:`interleaved_one_f_one_b` -- the same over ``v`` model chunks per rank, in
  Megatron-LM's order: groups of ``p`` micro-batches walk chunk 0, 1, ..., v-1 forward and
  chunk v-1, ..., 0 backward. Needs ``m % p == 0``.
* :func:`forward_only` -- every forward, for evaluation.

:func:`run_schedule` executes the steps: receive the input activation (unless this is the
first piece of the model), run the caller's forward, send the output on (unless this is
the last piece); for a backward, receive the output gradient, back-propagate, send the
input gradient back. Outputs already sent are deallocated (their data replaced by a
one-element tensor) so a rank holds at most the 1F1B bound of activations, not GPipe's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megalite.config import ConfigError
from megalite.pipeline.p2p import PipeComm

Step = tuple[str, int, int]


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
    if num_microbatches % pp_size:
        raise ConfigError(f"the interleaved pipeline schedule needs the number of "
                          f"micro-batches ({num_microbatches}) to be a multiple of "
                          f"pipeline_model_parallel_size ({pp_size}); change "
                          "--global-batch-size or --micro-batch-size")
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
                   train: bool = True) -> list[Step]:
    if not train:
        return forward_only(num_microbatches, vpp, pp_size)
    if vpp > 1:
        return interleaved_one_f_one_b(pp_size, pp_rank, num_microbatches, vpp)
    return one_f_one_b(pp_size, pp_rank, num_microbatches)


@dataclass
class ScheduleStats:
    """Per-rank timings of one schedule run (seconds) and peak live activations."""

    busy: float = 0.0
    waiting: float = 0.0
    peak_live_outputs: int = 0
    peak_activation_bytes: int = 0
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


def run_schedule(steps: list[Step], *, forward_step: Callable, ps, vpp: int,
                 comm: PipeComm | None, train: bool = True,
                 deallocate: bool = True, stats: ScheduleStats | None = None) -> None:
    """Execute ``steps`` on this pipeline rank.

    forward_step(chunk, microbatch, input_tensor) -> output: ``input_tensor`` is None on
    the first piece of the model (chunk 0 of pipeline rank 0); the output of the last
    piece is the scalar loss to back-propagate (already scaled by the caller), of any
    other piece the activation ``[s, b, h]`` to send on.
    comm: the :class:`PipeComm` of this rank (None when pp == 1).
    """
    pp, rank = ps.pp.size, ps.pp.rank
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}

    def first_piece(chunk: int) -> bool:
        return chunk == 0 and rank == 0

    def last_piece(chunk: int) -> bool:
        return chunk == vpp - 1 and rank == pp - 1

    for kind, chunk, mb in steps:
        t0 = time.perf_counter()
        waited0 = comm.wait_seconds if comm else 0.0
        if kind == "F":
            x = None if first_piece(chunk) else comm.recv_forward()
            with torch.set_grad_enabled(train):
                y = forward_step(chunk, mb, x)
            if not last_piece(chunk):
                comm.send_forward(y)
                if deallocate and train:
                    _deallocate(y)
            if train:
                inputs[(chunk, mb)], outputs[(chunk, mb)] = x, y
        else:
            dy = None if last_piece(chunk) else comm.recv_backward()
            x, y = inputs.pop((chunk, mb)), outputs.pop((chunk, mb))
            _backward(y, dy)
            if not first_piece(chunk):
                comm.send_backward(x.grad)
        if comm is not None:
            comm.reap()
        if stats is not None:
            waited = (comm.wait_seconds if comm else 0.0) - waited0
            elapsed = time.perf_counter() - t0
            stats.waiting += waited
            stats.busy += elapsed - waited
            stats.events.append((kind, chunk, mb, t0, elapsed, waited))
            stats.peak_live_outputs = max(stats.peak_live_outputs, len(outputs))
            live = sum(x.numel() * x.element_size() for x in inputs.values() if x is not None)
            stats.peak_activation_bytes = max(stats.peak_activation_bytes, live)
    if comm is not None:
        comm.wait_all()
