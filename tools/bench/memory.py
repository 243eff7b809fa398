"""Parameter, gradient and optimizer memory per rank, for each data-parallel sharding
strategy: measured vs ZeRO's accounting.

``python tools/benchmark.py memory [--dp 1 2 4 8] [--hidden-size 256] [--num-layers 4]
[--vocab-size 8192] [--tensor-model-parallel-size 1] [--grad-reduce-in-bf16]
[--optimizer-offload-fraction F]``

For each data-parallel size ``D`` it starts ``D x tp`` gloo ranks and, for each
``--data-parallel-sharding-strategy`` (:data:`megalite.config.parallel.SHARDING_STRATEGIES`),
builds the GPT model
in bf16 with the gradient buffers and the optimizer exactly as training does
(``megalite.optim.build``), runs one training step (forward, backward, data-parallel
reduction, optimizer step on a random batch; twice, the second one timed) and sums the
bytes of the storages each rank holds afterwards, between steps
(:func:`megalite.optim.memory.rank_memory`). The formula
(:func:`megalite.optim.memory.expected_bytes_per_param`), per parameter ``P`` of the rank's
model-parallel slice: params 2 B (bf16), divided by ``D`` under optim_grads_params;
grads 4 B (fp32 buffer; 2 B with ``--grad-reduce-in-bf16``), divided by ``D`` under
optim_grads and optim_grads_params; optimizer 12 B (fp32 master + Adam's two moments),
divided by ``D`` under all but no_shard. So bytes per parameter: no_shard 18, optim
2 + 4 + 12/D, optim_grads 2 + (4 + 12)/D, optim_grads_params (2 + 4 + 12)/D. ``grad MiB in
step``: the gradient bytes after backward, before the reduction (optim_grads and
optim_grads_params hold the full buffer while a step accumulates). ``gathered MiB``
(optim_grads_params): the most bytes of gathered full parameter copies held at once
during the timed step, against its formula ``x formula``: 2 B x the parameters of the
largest two neighbouring units (a layer and the prefetched next one; the output layer's
unit includes the tied embedding). ``step s``: wall time of the timed step; ``peak RSS
MiB``: the rank's resident-set high-water mark minus its size before the model was built
(one fresh process per run; includes activations and allocator slack).
``--optimizer-offload-fraction F`` adds rows with ``--optimizer-cpu-offload``: the device
keeps about 12 (1 - F) / D optimizer bytes, the host 16 F / D (master, a gradient copy,
two moments); whole parameters (pieces of the shard) move, so the split is at least ``F``:
their rows check device + 12/16 host bytes against 12 / D. Reported: rank 0's bytes per parameter,
total / formula, and the largest deviation
of any one of params, grads, optimizer from its formula.
"""

from __future__ import annotations

import argparse
import os

import torch

from megalite.config.parallel import SHARDING_STRATEGIES
from tools.bench import _ranks

MIB = 2.0 ** 20


def _config(args, world: int, strategy: str, offload: float | None):
    from megalite.arguments import parse_args

    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(max(1, args.hidden_size // 64)),
             "--seq-length", "128", "--max-position-embeddings", "128",
             "--vocab-size", str(args.vocab_size), "--bf16", "--micro-batch-size", "1",
             "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
             "--data-parallel-sharding-strategy", strategy]
    if offload is not None:
        flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(offload)]
    if args.grad_reduce_in_bf16:
        flags.append("--grad-reduce-in-bf16")
    if getattr(args, "optimizer", None):   # the planner's tests measure Muon's state too
        flags += ["--optimizer", args.optimizer]
    return parse_args(flags).validate(world)


def _runs(args) -> list[tuple[str, str, float | None]]:
    runs = [(s, s, None) for s in SHARDING_STRATEGIES]
    if args.optimizer_offload_fraction is not None:   # the sharded strategies
        runs += [(f"{s}+off{args.optimizer_offload_fraction:g}", s, args.optimizer_offload_fraction)
                 for s in SHARDING_STRATEGIES if s != "no_shard"]
    return runs


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _unit_pair_bytes(model) -> int:
    """Formula of the transient copy: 2 B x the parameters of the largest two neighbouring
    gather units (:func:`megalite.optim.param_sharding.find_units`), tied weights once."""
    from megalite.optim.param_sharding import find_units
    from megalite.pipeline.layout import model_chunks

    best = 0
    for chunk in model_chunks(model):
        units = [{id(p): p.numel() for p in u.params + u.uses} for u in find_units(chunk)]
        for a, b in zip(units, units[1:]):
            best = max(best, 2 * sum({**a, **b}.values()))
    return best


def measure(args, world: int, run: tuple) -> tuple:
    """This rank's (run name, strategy, offload fraction, RankMemory, grad bytes during
    the step, dp, gathered bytes peak, its formula, step seconds, peak RSS growth bytes)
    for one run (collective when ``world`` > 1)."""
    import resource
    import time

    from megalite.optim.build import build_grads_and_optimizer
    from megalite.optim.memory import rank_memory
    from megalite.parallel.state import ParallelState
    from megalite.training.build import default_model_provider

    name, strategy, offload = run
    cfg = _config(args, world, strategy, offload)
    ps = ParallelState.build(cfg.parallel)
    rss0 = _rss_kib()
    model = default_model_provider(cfg, ps).to(cfg.model.params_dtype)
    grads, optimizer = build_grads_and_optimizer(model, cfg, ps)
    gen = torch.Generator().manual_seed(1234)   # the same batch on every tp rank
    ids = torch.randint(0, args.vocab_size, (1, 128), generator=gen)
    labels = torch.randint(0, args.vocab_size, (1, 128), generator=gen)
    sharding = grads.param_sharding
    for _ in range(2):     # the first step starts from the model gathered whole
        if sharding is not None:
            sharding.reset_peak()
        start = time.perf_counter()
        grads.zero_grad(num_microbatches=1)
        model(ids, labels=labels).float().mean().backward()
        in_step = rank_memory(model, grads, optimizer).grads
        grads.finish_grad_sync()
        optimizer.step()
        grads.wait_param_sync()     # between steps: what the next forward starts from
        seconds = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    out = (name, strategy, offload, rank_memory(model, grads, optimizer), in_step, ps.dp.size,
           sharding.peak_gathered_bytes if sharding is not None else 0,
           _unit_pair_bytes(model) if sharding is not None else 0, seconds,
           max(peak_rss, 0) * 1024)
    grads.remove_hooks()
    ps.destroy()
    return out


def _measure_on_rank(rank: int, world: int, args, run: tuple) -> tuple:
    torch.manual_seed(0)
    return measure(args, world, run)


def run_world(args, world: int) -> list[tuple]:
    """Rank 0's measurements of every run, each on a fresh world of ``world`` ranks."""
    return [_ranks.run_on_ranks(_measure_on_rank, world, args, run)[0] for run in _runs(args)]


def main(argv=None) -> None:
    from megalite.optim.memory import expected_bytes_per_param

    parser = argparse.ArgumentParser(prog="benchmark.py memory")
    parser.add_argument("--dp", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--grad-reduce-in-bf16", action="store_true")
    parser.add_argument("--optimizer-offload-fraction", type=float, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    grad_bytes = 2 if args.grad_reduce_in_bf16 else 4
    print(f"memory per rank (rank 0) between steps, GPT hidden {args.hidden_size} x "
          f"{args.num_layers} layers, vocab {args.vocab_size}, bf16 params, "
          f"{'bf16' if grad_bytes == 2 else 'fp32'} grads, Adam, "
          f"tp {args.tensor_model_parallel_size}")
    print(f"{'dp':>3} {'strategy':>22} {'P/rank':>10} {'param B/P':>9} {'grad B/P':>8} "
          f"{'optim B/P':>9} {'total B/P':>9} {'formula':>8} {'x formula':>9} "
          f"{'grad MiB in step':>16} {'host B/P':>8} {'gathered MiB':>12} {'x formula':>9} "
          f"{'step s':>7} {'peak RSS MiB':>12}")
    worst = worst_gathered = 0.0
    for dp in args.dp:
        for (name, strategy, offload, mem, in_step, got_dp, gathered, gathered_formula,
             seconds, rss) in run_world(args, dp * args.tensor_model_parallel_size):
            assert got_dp == dp
            n = mem.num_params
            want = expected_bytes_per_param(strategy, dp, grad_bytes=grad_bytes)
            optim_bytes = mem.optimizer
            if offload is not None:   # whole pieces move: compare device + host state
                want["optimizer"] *= 1 - offload
                optim_bytes += mem.offloaded * 12 / 16
            formula = sum(want.values())
            total = (mem.params + mem.grads + mem.optimizer) / n
            ratios = [mem.params / (want["params"] * n), mem.grads / (want["grads"] * n),
                      optim_bytes / (expected_bytes_per_param(strategy, dp)["optimizer"] * n)]
            worst = max(worst, *(abs(r - 1) for r in ratios))
            shown = "-"
            if gathered_formula and dp > 1:
                worst_gathered = max(worst_gathered, abs(gathered / gathered_formula - 1))
                shown = f"{gathered / gathered_formula:.5f}"
            print(f"{dp:>3} {name:>22} {n:>10,} {mem.params / n:>9.3f} {mem.grads / n:>8.3f} "
                  f"{mem.optimizer / n:>9.3f} {total:>9.3f} {formula:>8.3f} "
                  f"{total / formula:>9.5f} {in_step / MIB:>16.3f} {mem.offloaded / n:>8.3f} "
                  f"{gathered / MIB:>12.3f} {shown:>9} {seconds:>7.3f} {rss / MIB:>12.1f}")
    print(f"largest deviation of params / grads / optimizer bytes from the formula: "
          f"{100 * worst:.2f}%; of the gathered copies (optim_grads_params, dp > 1): "
          f"{100 * worst_gathered:.2f}%")
