"""Pipeline bubble and activation memory of every schedule: measured vs theory.

``python tools/benchmark.py pipeline [--pipeline-model-parallel-size 4] [--microbatches 4 8 16]
[--schedules 1f1b interleaved_1f1b zb_h1 zbv dualpipev] [--virtual-pipeline-model-parallel-size 2]
[--forward-ms 30] [--compute sleep|matmul]``

Runs the real schedules (megalite.pipeline.schedules, gloo p2p) on ``p`` ranks. Each
micro-batch's forward through a whole stage costs ``--forward-ms`` and its backward twice
that, split evenly over the stage's ``v`` chunks (``--virtual-pipeline-model-parallel-size``,
for interleaved_1f1b; zbv and dualpipev always have two, in a V). The backward is half
input gradient, half weight gradient: a zero-bubble schedule (zb_h1, zbv, dualpipev) runs
the second half as its W step, through megalite's own deferral
(:mod:`megalite.parallel.weight_grad`). With ``--compute sleep`` (default) each cost is a sleep, so
``p`` ranks on a 2-core machine do not slow each other down and the measurement isolates the
schedule; ``--compute matmul`` burns real FLOPs instead (then ranks compete for cores once p >
cores, which inflates the busy time).

Each case runs one untimed warm-up iteration (the first transfers between two ranks
connect them; the plan is made once and cached), then ``--repeat`` timed ones, as a
training run's iterations; each rank reports its median iteration.

Reported per (m, schedule): the bubble as (step time - busy time) / busy time, averaged
over ranks (Megatron's definition), against the schedule's theory
(:func:`megalite.planner.schedule.bubble_fraction`: (p-1)/m for 1F1B, (p-1)/(v m)
interleaved, (p-1)/(3m) for ZB-H1, (p-1)/(6m) for ZB-V at m >= p and DualPipeV, whose
phases run one after the other here, at m >= 2p); the step time; and
per rank the peak number
of (micro-batch, chunk) pairs whose activations it holds (forward run, backward -- under a
zero-bubble schedule its W step -- not yet), measured and in theory
(:func:`megalite.planner.schedule.peak_in_flight`), with the bytes of the stage-boundary
activations ``[s, b, h]`` rank 0 keeps alive; GPipe (all forwards, then all backwards:
m) as the memory baseline.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from tools.bench import _ranks


def _schedules_on_rank(rank, world, cases, args):
    from megalite.config import ParallelConfig
    from megalite.parallel import weight_grad
    from megalite.parallel.state import ParallelState
    from megalite.pipeline.p2p import PipeComm
    from megalite.pipeline.schedules import (
        ScheduleStats,
        all_forward_then_backward,
        build_schedules,
        run_schedule,
    )

    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    weight = torch.randn(args.hidden_size, args.hidden_size) / args.hidden_size ** 0.5
    matmul_per_ms = None
    if args.compute == "matmul":  # calibrate: how many matmuls make a millisecond
        x = torch.randn(args.seq_length * args.micro_batch_size, args.hidden_size)
        t0 = time.perf_counter()
        for _ in range(50):
            x @ weight
        matmul_per_ms = 50 / ((time.perf_counter() - t0) * 1e3)

    def spend(ms):
        if matmul_per_ms is None:
            time.sleep(ms / 1e3)
        else:
            x = torch.randn(args.seq_length * args.micro_batch_size, args.hidden_size)
            for _ in range(max(1, round(ms * matmul_per_ms))):
                x @ weight

    class Cost(torch.autograd.Function):
        """Forward ``ms``; backward ``ms`` for the input gradient and ``ms`` for the
        weight gradient of ``w`` (a W step's, when the backward defers it)."""

        @staticmethod
        def forward(ctx, x, w, ms):
            ctx.ms = ms
            spend(ms)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            spend(ctx.ms)
            ms = ctx.ms

            def weight_gradient():
                spend(ms)
                return torch.zeros(1)
            return g * 1.0, weight_grad.weight_grad(w, weight_gradient), None

    w = torch.zeros(1, requires_grad=True)
    results = []
    for m, schedule, v in cases + [(m, "gpipe", 1) for m in sorted({c[0] for c in cases})]:
        pcfg = ParallelConfig(pipeline_model_parallel_size=world,
                              virtual_pipeline_model_parallel_size=v if v > 1 else None,
                              pipeline_schedule=schedule if schedule in ("zbv", "dualpipev")
                              else None)
        ps = ParallelState.build(pcfg)
        ms = args.forward_ms / v

        def forward_step(chunk, mb, x, ps=ps, ms=ms):
            h = torch.zeros(shape, requires_grad=True) if x is None else x
            h = Cost.apply(h, w, ms)
            if ps.is_pipeline_last_stage(chunk):
                return h.sum()
            return h

        comm = PipeComm(ps, shape, torch.float32)
        steps = ([all_forward_then_backward(m)] * world if schedule == "gpipe"
                 else build_schedules(world, m, v, schedule=schedule))
        # a warm-up iteration (the groups' first transfers connect the ranks, the plan is
        # made and cached), then the timed ones, as the iterations of a training run
        timed = []
        for _ in range(1 + args.repeat):
            stats = ScheduleStats()
            dist.barrier()
            t0 = time.perf_counter()
            run_schedule(steps, forward_step=forward_step,
                         ps=ps, vpp=v, comm=comm, stats=stats, v_shape=ps.v_shape)
            timed.append((time.perf_counter() - t0, stats))
            dist.barrier()
        total, stats = sorted(timed[1:], key=lambda t: t[0])[len(timed[1:]) // 2]
        results.append((m, schedule, v, total, stats.busy, stats.peak_pending_weight_grads))
        ps.destroy()
    return results


def main(argv=None) -> dict:
    """Print the table; return its rows, ``{(m, schedule, v): {"bubble", "theory",
    "step": seconds, "live": peak live micro-batches per rank, "live_theory",
    "gpipe_live": the same under GPipe}}``."""
    from megalite.config.parallel import (
        MULTI_CHUNK_SCHEDULES,
        NOT_IMPLEMENTED_SCHEDULES,
        PIPELINE_SCHEDULES,
    )
    from megalite.planner.schedule import bubble_fraction, peak_in_flight

    parser = argparse.ArgumentParser(prog="benchmark.py pipeline")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[4, 8, 16])
    runnable = [s for s in PIPELINE_SCHEDULES if s not in NOT_IMPLEMENTED_SCHEDULES]
    parser.add_argument("--schedules", nargs="*", choices=runnable, default=runnable)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, nargs="*",
                        default=[2], help="model chunks per rank of interleaved_1f1b")
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed iterations per case after one warm-up (the median's "
                             "rank times are reported)")
    args = parser.parse_args(argv)
    p = args.pipeline_model_parallel_size
    cases = []
    for schedule in args.schedules:
        if schedule == "zbv":   # two chunks per rank in a V, any m
            cases += [(m, schedule, 2) for m in args.microbatches]
        elif schedule == "dualpipev":   # the same V, m >= 2p
            cases += [(m, schedule, 2) for m in args.microbatches if m >= 2 * p]
        elif schedule in MULTI_CHUNK_SCHEDULES:
            cases += [(m, schedule, v) for v in args.virtual_pipeline_model_parallel_size
                      for m in args.microbatches if v > 1 and m % p == 0]
        else:
            cases += [(m, schedule, 1) for m in args.microbatches]
    by_rank = _ranks.run_on_ranks(_schedules_on_rank, p, cases, args)
    act_bytes = args.seq_length * args.micro_batch_size * args.hidden_size * 4
    print(f"pipeline bubble, p={p}, forward {args.forward_ms} ms + backward "
          f"{2 * args.forward_ms} ms (input gradient + weight gradient) per micro-batch per "
          f"stage, compute={args.compute}")
    gpipe_live = {by_rank[0][n][0]: [by_rank[r][n][5] for r in range(p)]
                  for n in range(len(cases), len(by_rank[0]))}
    print(f"{'m':>4} {'schedule':>18} {'bubble meas':>12} {'theory':>8} {'step ms':>9} "
          f"{'ideal ms':>9} {'peak live mb (rank0..)':>24} {'theory':>14} "
          f"{'act MB r0':>10} {'GPipe MB r0':>12}")
    out = {}
    for n, (m, schedule, v) in enumerate(cases):
        rows = [by_rank[r][n] for r in range(p)]
        total = max(r[3] for r in rows)  # the step's wall time: the slowest rank's
        bubble = sum((total - r[4]) / r[4] for r in rows) / p
        theory = bubble_fraction(p, m, v, schedule)
        ideal = m * 3 * args.forward_ms
        live = [r[5] for r in rows]
        live_theory = [peak_in_flight(p, r, m, v, schedule) for r in range(p)]
        name = schedule + (f" v{v}" if v > 1 else "")
        print(f"{m:>4} {name:>18} {bubble:>12.3f} {theory:>8.3f} {total * 1e3:>9.1f} "
              f"{ideal:>9.1f} {live!s:>24} {live_theory!s:>14} "
              f"{live[0] * act_bytes / 2**20 / v:>10.2f} "
              f"{gpipe_live[m][0] * act_bytes / 2**20:>12.2f}")
        out[(m, schedule, v)] = {"bubble": bubble, "theory": theory, "step": total,
                                 "live": live, "live_theory": live_theory,
                                 "gpipe_live": gpipe_live[m]}
    return out
