"""Zero-bubble pipeline schedules: each backward split into B and W steps.

A step ``("B", chunk, mb)`` of these schedules computes only the gradient of the piece's
input (and of the parameters outside the deferrable GEMMs); ``("W", chunk, mb)`` runs the
weight-gradient GEMMs that B deferred (:mod:`megalite.parallel.weight_grad`). Nobody
waits for a W, so a schedule places them where a rank would otherwise idle.

* :func:`zb_h1` -- ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024):
  1F1B's warm-up and its forward/B alternation, with rank ``r``'s W steps running ``r``
  B steps late (the first rank's without delay, in its steady state; the later ranks'
  fill the cool-down, where 1F1B leaves them idle). Every rank keeps at most ``p``
  micro-batches between their F and W (1F1B's peak, rank 0's, on every rank), and with
  equal F, B and W times the bubble is ``(p - 1) (T_F + T_B - T_W)`` against 1F1B's
  ``(p - 1) (T_F + T_B + T_W)``: a third of it. Any ``m``, one chunk per rank.

:func:`simulate` plays any step lists with given step times (the dependencies of the
pipeline, every rank in its own order, as soon as inputs are there) and returns the step
time and each rank's idle fraction: the theory every schedule's bubble is measured against
(``tools/bench/pipeline.py``) and that the planner uses (``megalite.planner.schedule``).
"""

from __future__ import annotations

from megalite.pipeline.plan import Step, piece_of


def zb_h1(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Step]:
    """ZB-H1 steps of pipeline rank ``pp_rank`` (see module docstring)."""
    m, r = num_microbatches, pp_rank
    warmup = min(pp_size - r - 1, m)
    steps: list[Step] = [("F", 0, i) for i in range(warmup)]
    done_w = 0

    def backward(i: int) -> None:
        nonlocal done_w
        steps.append(("B", 0, i))
        if i + 1 > r:            # W runs r backward steps behind B
            steps.append(("W", 0, done_w))
            done_w += 1

    for i in range(m - warmup):
        steps.append(("F", 0, warmup + i))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    steps += [("W", 0, i) for i in range(done_w, m)]
    return steps


def simulate(rank_steps: list[list[Step]], vpp: int = 1, *, forward: float = 1.0,
             backward: float = 2.0, weight: float | None = None,
             v_shape: bool = False) -> tuple[float, list[float]]:
    """(step time, idle fraction per rank) of ``rank_steps`` when each F takes
    ``forward``, each fused backward ``backward`` (split: B ``backward - weight``, W
    ``weight``; default ``weight = backward / 2``) and transfers take no time. The idle
    fraction of a rank is ``(step time - its busy time) / its busy time``, the measured
    bubble's definition (``tools/bench/pipeline.py``). Pieces are placed as the plan
    places them (``megalite.pipeline.plan``; ``v_shape``: the V placement of ZB-V)."""
    pp = len(rank_steps)
    split = any(s[0] == "W" for steps in rank_steps for s in steps)
    w = (backward / 2 if weight is None else weight) if split else 0.0
    cost = {"F": forward, "B": backward - w, "W": w}
    last = pp * vpp - 1
    done: dict[tuple[int, str, int], float] = {}   # (piece, kind, mb) -> finish time
    pos, clock, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(rank_steps[r]):
                kind, chunk, mb = rank_steps[r][pos[r]]
                piece = piece_of(r, chunk, pp, v_shape)
                deps = []
                if kind == "F" and piece > 0:
                    deps.append((piece - 1, "F", mb))
                elif kind == "B":
                    deps.append((piece, "F", mb))
                    if piece < last:
                        deps.append((piece + 1, "B", mb))
                elif kind == "W":
                    deps.append((piece, "B", mb))
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + cost[kind]
                busy[r] += cost[kind]
                done[(piece, kind, mb)] = clock[r]
                pos[r] += 1
                moved = True
    if any(pos[r] < len(rank_steps[r]) for r in range(pp)):
        raise ValueError("the step lists do not fit together (a step waits forever)")
    total = max(clock)
    return total, [(total - b) / b if b else 0.0 for b in busy]
