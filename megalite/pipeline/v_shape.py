"""Pipeline schedules over the V placement: two model chunks per rank, the first and the
last layers on rank 0.

The model is cut into ``2p`` pieces; rank ``r`` holds piece ``r`` (chunk 0) and piece
``2p - 1 - r`` (chunk 1) (:func:`megalite.pipeline.plan.piece_of` with ``v_shape``). A
micro-batch goes down the ranks in chunk 0, turns on the last rank without a transfer,
and comes back up in chunk 1; rank 0 computes the loss, and its gradient retraces the V.

* :func:`zbv` -- ZB-V of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): each
  backward split into B (input gradient) and W (weight gradients,
  :mod:`megalite.parallel.weight_grad`), the steps of all ranks laid out together by a
  greedy list scheduler on unit step times (F = B = W, one chunk): in every time slot a
  rank runs the B that is ready (the older micro-batch first), else a ready F while it
  holds fewer than ``2p`` chunk-activations (``p`` stages' worth: 1F1B's peak, rank 0's),
  else a W it deferred. Micro-batches enter each chunk in order. With equal times the
  step time is ``m`` slots of ``F + B + W`` per chunk plus the ramp, so the bubble falls
  toward zero as ``m`` grows past ``2p`` (``tests/pipeline/test_zbv.py`` pins the
  simulated values), against interleaved 1F1B's ``(p - 1) / (2 m)`` at the same memory.

Bubble and timings come from :func:`megalite.pipeline.zero_bubble.simulate` with
``v_shape=True``; transfers from :func:`megalite.pipeline.plan.plan_rounds` with
``v_shape=True``.
"""

from __future__ import annotations

import functools

from megalite.pipeline.plan import Step, destination, needs_input

V_CHUNKS = 2   # model chunks per rank of every V schedule


@functools.lru_cache(maxsize=64)
def zbv_all(pp: int, num_microbatches: int) -> tuple[tuple[Step, ...], ...]:
    """ZB-V steps of every pipeline rank (index: pipeline rank), see the module docstring.

    The greedy runs in unit time slots: a step may start in slot ``t`` once the step it
    depends on (the previous piece's F, the next piece's B, its own B for a W) finished in
    a slot before ``t``.
    """
    m, v = num_microbatches, V_CHUNKS
    cap = 2 * pp                              # chunk-activations held, F to W
    next_f = [[0] * v for _ in range(pp)]     # next micro-batch entering each chunk
    next_b = [[0] * v for _ in range(pp)]
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]   # (chunk, mb) to W
    ready: dict[tuple[int, Step], int] = {}   # (rank, step) -> slot its input is there
    steps: list[list[Step]] = [[] for _ in range(pp)]
    total = 3 * v * m
    t = 0
    while sum(map(len, steps)) < total * pp:
        ran: list[Step | None] = [None] * pp
        for r in range(pp):
            live = sum(next_f[r]) - (len(steps[r]) - sum(next_f[r]) - sum(next_b[r]))

            def is_ready(step: Step, rank: int = r) -> bool:
                if not needs_input(step, rank, pp, v, True):
                    return True
                return ready.get((rank, step), t + 1) <= t

            bs = [("B", c, next_b[r][c]) for c in range(v)
                  if next_b[r][c] < min(m, next_f[r][c])]
            bs = [s for s in bs if is_ready(s)]
            fs = [("F", c, next_f[r][c]) for c in reversed(range(v)) if next_f[r][c] < m]
            fs = [s for s in fs if is_ready(s)]
            if bs:
                step = min(bs, key=lambda s: (s[2], -s[1]))
            elif fs and live < cap:
                step = fs[0]
            elif deferred[r]:
                step = ("W", *deferred[r].pop(0))
            else:
                continue
            ran[r] = step
            kind, c, mb = step
            if kind == "F":
                next_f[r][c] += 1
            elif kind == "B":
                next_b[r][c] += 1
                deferred[r].append((c, mb))
            steps[r].append(step)
        if not any(ran):
            raise AssertionError(f"ZB-V greedy stuck at slot {t} (p {pp}, m {m})")
        for r, step in enumerate(ran):
            dest = destination(step, r, pp, v, True) if step else None
            if dest:
                ready[dest] = t + 1
        t += 1
    return tuple(tuple(s) for s in steps)


def zbv(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """ZB-V steps of pipeline rank ``pp_rank`` (see :func:`zbv_all`)."""
    return list(zbv_all(pp_size, num_microbatches)[pp_rank])


def v_forward_only(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """Every forward of a V placement (evaluation): chunk 0's micro-batches, then chunk
    1's."""
    del pp_size, pp_rank
    return [("F", c, mb) for c in range(V_CHUNKS) for mb in range(num_microbatches)]

