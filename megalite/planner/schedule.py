"""What a pipeline stage holds and how many micro-batches it keeps in flight.

Both come from megalite's own pipeline code, so the planner cannot drift from it: the
layers of a stage from :func:`megalite.config.layout.chunk_layer_ranges`, the in-flight
count by walking the stage's step list of :func:`megalite.pipeline.schedules.build_schedule`.
"""

from __future__ import annotations

import functools

from megalite.config.layout import chunk_layer_ranges
from megalite.config.parallel import is_v_schedule
from megalite.pipeline.plan import pairs_of
from megalite.pipeline.schedules import build_schedule
from megalite.pipeline.zero_bubble import simulate


def stage_layers(m, p, pp_rank: int) -> list[int]:
    """Global indices of the transformer layers on pipeline rank ``pp_rank`` (all its
    virtual chunks)."""
    ranges = chunk_layer_ranges(m.num_layers, p.pipeline_model_parallel_size,
                                p.virtual_pipeline_model_parallel_size,
                                p.decoder_first_pipeline_num_layers,
                                p.decoder_last_pipeline_num_layers,
                                is_v_schedule(p.pipeline_schedule))
    return [first + i for first, n in ranges[pp_rank] for i in range(n)]


def output_stage(p) -> int:
    """The pipeline rank holding the final norm, the output layer and the loss: the last,
    or under ZB-V's V placement the first (``megalite.pipeline.v_shape``)."""
    return 0 if is_v_schedule(p.pipeline_schedule) else p.pipeline_model_parallel_size - 1


@functools.lru_cache(maxsize=4096)
def peak_in_flight(pp: int, pp_rank: int, num_microbatches: int, vpp: int = 1,
                   schedule: str | None = None, chunk: int | None = None) -> int:
    """Peak number of (micro-batch, chunk) forwards whose backward has not run yet on
    ``pp_rank``: the activations it holds at once, in units of one chunk's activations
    for one micro-batch (1F1B: ``min(pp - pp_rank, m)``; interleaved: more, in smaller
    chunks). Under a zero-bubble schedule (``zb_h1``, ``zbv``) a micro-batch counts until
    its W step, which still needs the saved inputs of the weight GEMMs (an upper bound: B
    frees the rest): ZB-H1 holds ``min(pp, m)`` on every rank, 1F1B's rank-0 peak; ZB-V
    at most ``2 min(pp, m)`` half-stage chunks, the same bytes; DualPipeV ``2 pp + 1``
    (:func:`dualpipev_in_flight`). ``chunk``: count that model chunk's micro-batches only
    (the output chunk's, for what the multi-token prediction depths keep)."""
    steps = build_schedule(pp, pp_rank, num_microbatches, vpp, schedule=schedule)
    done = "W" if any(kind == "W" for kind, _, _ in steps) else "B"
    live = peak = 0
    for kind, step_chunk, _mb in steps:
        if chunk is not None and step_chunk != chunk:
            continue
        live += 1 if kind == "F" else -1 if kind == done else 0
        peak = max(peak, live)
    return peak


def dualpipev_bubble(pp: int, num_microbatches: int) -> float:
    """DualPipeV's idle fraction as megalite runs it: ``(pp - 1) / (6 m)``, ZB-V's.

    It is what megalite's own step lists give when played with free transfers
    (:func:`megalite.pipeline.zero_bubble.simulate` of
    :func:`megalite.pipeline.v_shape.dualpipev`), the number the pipeline benchmark's
    theory column shows. DeepSeek-V3's table (arXiv:2412.19437, Table 2; the DualPipe
    repository's row for DualPipeV over ``PP = 2 pp`` stages) writes the bubble as
    ``(PP/2 - 1)(F&B + B - 3W)``; with no overlap inside a pair (megalite runs the paired
    forward and backward one after the other on one stream, so ``F&B = F + B``) and ``B =
    2F``, ``W = F`` that reads ``(pp - 1) / (3 m)``, an upper bound megalite's schedule
    beats: the measured bubble at p 2 (0.050 / 0.027 at m 4 / 8, ``docs/benchmarks.md``)
    is below it (0.083 / 0.042), and above the step lists' value by the per-step fixed
    costs the planner charges elsewhere."""
    return (pp - 1) / (6 * num_microbatches)


def dualpipev_in_flight(pp: int) -> int:
    """DualPipeV's activation per rank by DeepSeek-V3's table: ``PP + 1`` chunks of one
    micro-batch (``PP = 2 pp`` stages of ``L / 2pp`` layers), one chunk more than ZB-V's
    ``2 pp`` (what :func:`peak_in_flight` walks from the step lists, too)."""
    return 2 * pp + 1


@functools.lru_cache(maxsize=4096)
def bubble_fraction(pp: int, num_microbatches: int, vpp: int = 1,
                    schedule: str | None = None) -> float:
    """Idle fraction of the pipeline's ideal time. 1F1B and its interleaved variant:
    ``(pp - 1) / (vpp m)`` (Megatron-LM's). A zero-bubble schedule: its step lists played
    with a backward twice the forward, split evenly into B and W, each chunk ``1 / vpp``
    of the stage (:func:`megalite.pipeline.zero_bubble.simulate`): ZB-H1 gives
    ``(pp - 1) / (3 m)`` for ``m >= pp``, a third of 1F1B's; ZB-V ``(pp - 1) / (6 m)``
    for ``m >= pp``, a sixth. DualPipeV: DeepSeek-V3's formula without the overlap megalite
    does not do (:func:`dualpipev_bubble`: ``(pp - 1) / (3 m)``)."""
    if schedule is None or schedule in ("1f1b", "interleaved_1f1b"):
        return (pp - 1) / (vpp * num_microbatches)
    if schedule == "dualpipev":
        return dualpipev_bubble(pp, num_microbatches)
    steps = [build_schedule(pp, r, num_microbatches, vpp, schedule=schedule)
             for r in range(pp)]
    _, idle = simulate(steps, vpp, forward=1.0 / vpp, backward=2.0 / vpp,
                       weight=1.0 / vpp, v_shape=is_v_schedule(schedule))
    return sum(idle) / pp


@functools.lru_cache(maxsize=4096)
def paired_backward_share(pp: int, num_microbatches: int, vpp: int = 1,
                          schedule: str | None = None) -> float:
    """Under ``--overlap-moe-expert-parallel-comm``: the share of a rank's backward steps
    that run paired with the next forward (the pipeline plan's pairs,
    :func:`megalite.pipeline.plan.pairs_of`), on the pipeline rank with the fewest (the one
    whose all-to-all stays most exposed). 1F1B: ``(m - pp) / m`` on the first stage
    (``m - 1`` of ``m`` at pp 1); 0 for the schedules the overlap refuses (zb_h1, zbv,
    dualpipev: the plan pairs nothing in a V or among W steps)."""
    steps = [build_schedule(pp, r, num_microbatches, vpp, schedule=schedule)
             for r in range(pp)]
    pairs = pairs_of(steps, vpp, is_v_schedule(schedule))
    return min(len(at) / max(1, sum(kind == "B" for kind, _, _ in s))
               for at, s in zip(pairs, steps))
