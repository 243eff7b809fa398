"""Pipeline bubble and activation memory: measured vs theory.

``python tools/benchmark.py pipeline [--pipeline-model-parallel-size 4] [--microbatches 4 8 16]
[--virtual-pipeline-model-parallel-size 1 2] [--forward-ms 30] [--compute sleep|matmul]``

Runs the real schedules (megalite.pipeline.schedules, gloo p2p) on ``p`` ranks. Each
micro-batch's forward through a whole stage costs ``--forward-ms`` and its backward twice
that, split evenly over the stage's ``v`` chunks. With ``--compute sleep`` (default) that
cost is a sleep, so ``p`` ranks on a 2-core machine do not slow each other down and the
measurement isolates the schedule; ``--compute matmul`` burns real FLOPs instead (then
ranks compete for cores once p > cores, which inflates the busy time).

Reported per (m, v): the bubble as (step time - busy time) / busy time, averaged over
ranks (Megatron's
definition: theory (p-1)/m for 1F1B and (p-1)/(v*m) interleaved), and the peak number of
micro-batches whose activations a rank holds, measured for 1F1B (theory: p - rank) and for
all-forward-then-backward (GPipe, theory: m), with the bytes of the stage-boundary
activations ``[s, b, h]`` that rank 0 keeps alive.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from tools.bench import _ranks


def _schedules_on_rank(rank, world, cases, args):
    from megalite.config import ParallelConfig
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
        @staticmethod
        def forward(ctx, x, ms):
            ctx.ms = ms
            spend(ms)
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            spend(2 * ctx.ms)
            return g * 1.0, None

    results = []
    for m, v in cases + [(m, "gpipe") for m in sorted({m for m, _ in cases})]:
        gpipe = v == "gpipe"
        v = 1 if gpipe else v
        pcfg = ParallelConfig(pipeline_model_parallel_size=world,
                              virtual_pipeline_model_parallel_size=v if v > 1 else None)
        ps = ParallelState.build(pcfg)
        ms = args.forward_ms / v

        def forward_step(chunk, mb, x, ps=ps, ms=ms):
            h = torch.zeros(shape, requires_grad=True) if x is None else x
            h = Cost.apply(h, ms)
            if ps.is_pipeline_last_stage(chunk):
                return h.sum()
            return h

        comm = PipeComm(ps, shape, torch.float32)
        stats = ScheduleStats()
        dist.barrier()
        t0 = time.perf_counter()
        steps = ([all_forward_then_backward(m)] * world if gpipe
                 else build_schedules(world, m, v))
        run_schedule(steps, forward_step=forward_step,
                     ps=ps, vpp=v, comm=comm, stats=stats)
        total = time.perf_counter() - t0
        dist.barrier()
        results.append((m, v, total, stats.busy, stats.waiting, stats.peak_live_outputs))
        ps.destroy()
    return results


def main(argv=None) -> dict:
    """Print the table; return its rows, ``{(m, v): {"bubble", "theory", "step": seconds,
    "live": peak live micro-batches per rank, "gpipe_live": the same under GPipe}}``."""
    parser = argparse.ArgumentParser(prog="benchmark.py pipeline")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, nargs="*",
                        default=[1, 2])
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--compute", choices=("sleep", "matmul"), default="sleep")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=512)
    args = parser.parse_args(argv)
    p = args.pipeline_model_parallel_size
    cases = [(m, v) for v in args.virtual_pipeline_model_parallel_size
             for m in args.microbatches if m % p == 0 or v == 1]
    by_rank = _ranks.run_on_ranks(_schedules_on_rank, p, cases, args)
    act_bytes = args.seq_length * args.micro_batch_size * args.hidden_size * 4
    print(f"pipeline bubble, p={p}, forward {args.forward_ms} ms + backward "
          f"{2 * args.forward_ms} ms per micro-batch per stage, compute={args.compute}")
    gpipe_live = {by_rank[0][n][0]: [by_rank[r][n][5] for r in range(p)]
                  for n in range(len(cases), len(by_rank[0]))}
    print(f"{'m':>4} {'v':>3} {'bubble meas':>12} {'theory':>8} {'step ms':>9} "
          f"{'ideal ms':>9} {'peak live mb (rank0..)':>24} {'GPipe meas':>14} "
          f"{'act MB r0':>10} {'GPipe MB r0':>12}")
    out = {}
    for n, (m, v) in enumerate(cases):
        rows = [by_rank[r][n] for r in range(p)]
        total = max(r[2] for r in rows)  # the step's wall time: the slowest rank's
        bubble = sum((total - busy) / busy for _, _, _, busy, _, _ in rows) / p
        theory = (p - 1) / (v * m)
        ideal = m * 3 * args.forward_ms
        live = [r[5] for r in rows]
        print(f"{m:>4} {v:>3} {bubble:>12.3f} {theory:>8.3f} {total * 1e3:>9.1f} "
              f"{ideal:>9.1f} {live!s:>24} {gpipe_live[m]!s:>14} "
              f"{live[0] * act_bytes / 2**20 / v:>10.2f} "
              f"{gpipe_live[m][0] * act_bytes / 2**20:>12.2f}")
        out[(m, v)] = {"bubble": bubble, "theory": theory, "step": total, "live": live,
                       "gpipe_live": gpipe_live[m]}
    return out
