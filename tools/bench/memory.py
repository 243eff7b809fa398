"""Parameter, gradient and optimizer memory per rank: measured vs Megatron's accounting.

``python tools/benchmark.py memory [--dp 1 2 4] [--hidden 256] [--layers 4] [--vocab 8192]
[--tp 1] [--grad-reduce-in-bf16]``

For each data-parallel size ``D`` it starts ``D x tp`` gloo ranks, builds the GPT model in
bf16 with the gradient buffers and the optimizer exactly as training does
(``megalite.optim.build``), once with the plain optimizer and once with
``--use-distributed-optimizer``, and sums the bytes of the storages each rank actually
holds (:func:`megalite.optim.memory.rank_memory`). The formula, per parameter ``P`` of the
rank's model-parallel slice: params 2 B (bf16), grads 4 B (fp32 buffer; 2 B with
``--grad-reduce-in-bf16``), optimizer 12 B (fp32 master + Adam's two moments), divided by
``D`` under the distributed optimizer. Reported: rank 0's bytes and measured / formula.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.ranks import run_on_ranks

MIB = 2.0 ** 20


def _config(args, world: int, distributed: bool):
    from megalite.arguments import parse_args

    flags = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
             "--num-attention-heads", str(max(1, args.hidden // 64)),
             "--seq-length", "128", "--max-position-embeddings", "128",
             "--vocab-size", str(args.vocab), "--bf16", "--micro-batch-size", "1",
             "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--tensor-model-parallel-size", str(args.tp)]
    if distributed:
        flags.append("--use-distributed-optimizer")
    if args.grad_reduce_in_bf16:
        flags.append("--grad-reduce-in-bf16")
    return parse_args(flags).validate(world)


def measure(args, world: int) -> list[tuple]:
    """This rank's (optimizer kind, RankMemory, dp) for the plain and the distributed
    optimizer (collective when ``world`` > 1)."""
    from megalite.optim.build import build_grads_and_optimizer
    from megalite.optim.memory import rank_memory
    from megalite.parallel.state import ParallelState
    from megalite.training.build import default_model_provider

    out = []
    for distributed in (False, True):
        cfg = _config(args, world, distributed)
        ps = ParallelState.build(cfg.parallel)
        model = default_model_provider(cfg, ps).to(torch.bfloat16)
        grads, optimizer = build_grads_and_optimizer(model, cfg, ps)
        out.append(("distributed" if distributed else "plain",
                    rank_memory(model, grads, optimizer), ps.dp.size))
        grads.remove_hooks()
        ps.destroy()
    return out


def _measure_on_rank(rank: int, world: int, args) -> list[tuple]:
    return measure(args, world)


def run_world(args, world: int) -> list[tuple]:
    """Rank 0's measurements on a world of ``world`` ranks (in-process when 1)."""
    if world == 1:
        return measure(args, 1)
    return run_on_ranks(_measure_on_rank, world, args)[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="benchmark.py memory")
    parser.add_argument("--dp", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--grad-reduce-in-bf16", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    grad_bytes = 2 if args.grad_reduce_in_bf16 else 4
    print(f"memory per rank (rank 0), GPT hidden {args.hidden} x {args.layers} layers, "
          f"vocab {args.vocab}, bf16 params, {'bf16' if grad_bytes == 2 else 'fp32'} grads, "
          f"Adam, tp {args.tp}")
    print(f"{'dp':>3} {'optimizer':>12} {'P/rank':>11} {'param MiB':>10} {'x formula':>9} "
          f"{'grad MiB':>9} {'x formula':>9} {'optim bytes':>12} {'formula bytes':>14} "
          f"{'x formula':>9} {'B/param':>8}")
    for dp in args.dp:
        for kind, mem, got_dp in run_world(args, dp * args.tp):
            assert got_dp == dp
            n = mem.num_params
            optim_formula = 12 * n / (dp if kind == "distributed" else 1)
            print(f"{dp:>3} {kind:>12} {n:>11,} {mem.params / MIB:>10.3f} "
                  f"{mem.params / (2 * n):>9.5f} {mem.grads / MIB:>9.3f} "
                  f"{mem.grads / (grad_bytes * n):>9.5f} {mem.optimizer:>12,} "
                  f"{optim_formula:>14,.0f} {mem.optimizer / optim_formula:>9.5f} "
                  f"{mem.optimizer / n:>8.3f}")
