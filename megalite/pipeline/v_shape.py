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
  step is ``6m`` chunk slots plus one chunk forward per further stage: a bubble of
  ``(p - 1) / (6 m)`` once ``m >= p`` (``tests/pipeline/test_zbv.py`` pins it), against
  ZB-H1's ``(p - 1) / (3 m)`` and interleaved 1F1B's ``(p - 1) / (2 m)`` at vpp 2. For
  equal times no order does better: the last rank's first input arrives after ``p - 1``
  chunk forwards and it still has its ``6m`` steps to run.

* :func:`dualpipev` -- DualPipeV, the V form of DeepSeek-V3's DualPipe (DeepSeek-AI,
  "DeepSeek-V3 Technical Report", 2024; the ``dualpipev`` schedule of the DualPipe
  repository): eight phases per rank ``r`` -- ``2(p-r-1)`` chunk-0 forwards; ``r+1``
  pairs F0 F1; ``p-r-1`` times B1 W1 F1; the main phase of ``m - 2p + r + 1`` times
  F0 B1 F1 B0 (on a GPU each forward overlapped with the other chunk's backward, their
  all-to-alls hidden behind each other's compute; here they run one after the other);
  ``p-r-1`` times B1 F1 B0; ``r+1`` pairs B1 B0 whose second half defers its W; ``p-r-1``
  times W B0 (deferred); the ``r+1`` W left. A backward outside those zero-bubble phases
  is B with its W right after it. Needs ``m >= 2p``.

Bubble and timings come from :func:`megalite.pipeline.zero_bubble.simulate` with
``v_shape=True``; transfers from :func:`megalite.pipeline.plan.plan_rounds` with
``v_shape=True``.
"""

from __future__ import annotations

import functools

from megalite.config.fields import require
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


def dualpipev(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """DualPipeV steps of pipeline rank ``pp_rank`` (see the module docstring)."""
    p, r, m = pp_size, pp_rank, num_microbatches
    require(m >= 2 * p, f"--pipeline-schedule dualpipev needs at least 2 x pipeline size "
                        f"({2 * p}) micro-batches per step, got {m}; raise "
                        "--global-batch-size or lower --micro-batch-size")
    steps: list[Step] = []
    next_f, next_b = [0, 0], [0, 0]
    deferred: list[Step] = []

    def forward(c: int) -> None:
        steps.append(("F", c, next_f[c]))
        next_f[c] += 1

    def backward(c: int, zero_bubble: bool = False) -> None:
        step = ("B", c, next_b[c])
        next_b[c] += 1
        steps.append(step)
        if zero_bubble:   # its W waits in the queue for a later weight step
            deferred.append(("W", c, step[2]))
        else:
            steps.append(("W", c, step[2]))

    def weight() -> None:
        steps.append(deferred.pop(0))

    for _ in range(2 * (p - r - 1)):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(p - r - 1):
        backward(1, zero_bubble=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + r + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - r - 1):
        backward(1)
        forward(1)
        backward(0)
    half = (r + 1) // 2   # from here on the backwards defer their W
    for i in range(r + 1):
        backward(1, zero_bubble=i > half or (i == half and r % 2 == 1))
        backward(0, zero_bubble=i >= half)
    for _ in range(p - r - 1):
        weight()
        backward(0, zero_bubble=True)
    while deferred:
        weight()
    return steps


def v_forward_only(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """Every forward of a V placement (evaluation): chunk 0's micro-batches, then chunk
    1's."""
    del pp_size, pp_rank
    return [("F", c, mb) for c in range(V_CHUNKS) for mb in range(num_microbatches)]

