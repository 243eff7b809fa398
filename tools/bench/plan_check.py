"""The planner's time model against measured step times on this CPU.

``python tools/benchmark.py plan-check [--repeat 5] [--layouts NAME ...] [--json PATH]``

The 'cluster' is this machine, measured on the same gloo ranks that train, interleaved
with the step timings: before each timed step of a layout every rank of its world runs
the probes at once (so a figure is the rank's share of the cores: a world of 2 ranks on
2 cores gets a core each, one of 4 ranks half a core), and the figures a layout's
estimate uses are medians over its repeats:

* the effective FLOP/s of one of the layout's transformer layers as a rank runs it (this
  rank's share of heads, ffn and sequence, forward and backward, its fixed cost taken
  out; :meth:`megalite.planner.measure.OverheadProbe.layer_rate`: what a layer runs
  besides GEMMs is in the rate), the slowest rank's; for reference also the GEMMs alone
  on the layout's shapes (:func:`~megalite.planner.measure.matmul_rate`), which leave the
  estimates about 30% short;
* gloo latency per ring hop and bandwidth on the world, from an all-gather and a
  reduce-scatter of 4 bytes and of 4 MiB
  (:func:`~megalite.planner.measure.collective_speed`);
* what one collective costs between compute beyond that latency and bandwidth: the
  sequence-parallel all-gather / reduce-scatter of one micro-batch's activations between
  the layout's per-rank GEMMs, against the GEMMs alone, on the group the layout's
  collectives mostly run on (tp, else pp, else dp;
  :func:`~megalite.planner.measure.tp_collective_cost`). Back to back a gloo
  collective of 128 KiB costs about what latency and bandwidth say; between GEMMs about
  twice (gloo's worker and transport threads wake on cores the ranks compute on, and the
  rank that arrives first waits for the other), which left every tp layout 31-42% short;
* memory bandwidth of an out-of-cache add;
* the fixed cost of one more layer per micro-batch, forward and backward and forward
  alone, and of the rest of a micro-batch, timed on megalite's own GPT at hidden 32
  (:class:`~megalite.planner.measure.OverheadProbe`).

Each layout trains a small GPT (4 layers, hidden 256, seq 128, global batch 8; matmuls
dominate, the fixed costs are a tenth): one warm-up step, then ``--repeat`` timed steps
(barrier to barrier, batches fetched beforehand), the median reported. The layouts are
chosen so that their step times differ clearly (single rank with and without full
recomputation, dp2, tp2, pp2 with 8 and 2 micro-batches, pp2 under ZB-V, ZB-H1 and
DualPipeV, dp2 with
recomputation, four ranks on two cores, ...). Printed: per layout, estimated and measured
ms with the main terms, the seconds a rank spent blocked in collectives per step and how many each
group ran (the flight recorder's count: compare with the estimate's tp/pp/dp terms), the Spearman
rank correlation of the estimates with the measurements (>= 0.8 wanted) and the largest relative
error (<= 25%). ``tests/planner/test_time_model.py`` (slow) runs it and asserts both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

BASE_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "128", "--max-position-embeddings", "128",
              "--vocab-size", "511", "--make-vocab-size-divisible-by", "8",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1000",
              "--mock-data", "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--attention-backend", "sdpa", "--eval-iters", "0",
              "--log-interval", "100000", "--lr", "1e-4"]
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# (name, world size, flags over BASE_FLAGS): step times spread over about 4x
LAYOUTS = (
    ("w1", 1, []),
    ("w1-full", 1, FULL),
    ("w1-mbs1", 1, ["--micro-batch-size", "1"]),
    ("w2-dp2", 2, []),
    ("w2-dp2-full", 2, FULL),
    ("w2-tp2", 2, TP2),
    ("w2-pp2", 2, PP2 + ["--micro-batch-size", "1"]),
    ("w2-pp2-mbs4", 2, PP2 + ["--micro-batch-size", "4"]),
    # ZB-V: two 1-layer chunks per rank in a V, the split backward, 8 micro-batches
    ("w2-pp2-zbv", 2, PP2 + ["--pipeline-schedule", "zbv", "--micro-batch-size", "1"]),
    # ZB-H1 (one 2-layer stage per rank, B and W apart) and DualPipeV (ZB-V's V, paired
    # forward and backward steps), 8 micro-batches each
    ("w2-pp2-zbh1", 2, PP2 + ["--pipeline-schedule", "zb_h1", "--micro-batch-size", "1"]),
    ("w2-pp2-dualpipev", 2, PP2 + ["--pipeline-schedule", "dualpipev",
                                   "--micro-batch-size", "1"]),
    ("w2-tp2-full", 2, TP2 + FULL),
    ("w4-dp4", 4, ["--micro-batch-size", "1"]),
    ("w4-tp2-dp2", 4, TP2 + ["--micro-batch-size", "1"]),
)


def layout_config(world: int, flags: list[str], base: list[str] | None = None):
    """The layout's validated config: ``flags`` over ``base`` (:data:`BASE_FLAGS`)."""
    from megalite.arguments import parse_args

    return parse_args((BASE_FLAGS if base is None else base) + flags).validate(world)


def planner_config(cfg):
    """The config the planner estimates: the vocabulary the tokenizer really has."""
    import copy

    from megalite.data.tokenizers import build_tokenizer

    cfg = copy.deepcopy(cfg)
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    return cfg


def _probe(cfg, world: int, overhead, ps) -> dict:
    """This rank's probes, all ranks at once (collective)."""
    import torch.distributed as dist

    from megalite.planner.measure import (
        collective_speed,
        layout_gemms,
        matmul_rate,
        memory_bandwidth,
        tp_collective_cost,
    )

    if world > 1:
        dist.barrier()
    # long enough to be the sustained rate: a short burst right after a barrier (a sleep)
    # gets more than its share of a loaded machine
    out = {"flops": matmul_rate(layout_gemms(planner_config(cfg)), seconds=0.25)}
    out["memory_bw"] = memory_bandwidth()
    out.update(overhead.measure(repeats=3))
    out["layer_flops"] = overhead.layer_rate(planner_config(cfg), out["layer"])
    # bandwidth from at least 4 MiB (the gradients' reduction; an activation alone is
    # mostly latency, whose noise would swamp the difference)
    out["latency"], out["bw"] = collective_speed(4 << 20)
    # an all-gather / reduce-scatter between a layer's GEMMs, on the group the layout's
    # collectives mostly run on (tp, else pp, else dp); its size and gathered bytes
    group = next((g for g in (ps.tp, ps.pp, ps.dp) if g.size > 1), ps.tp)
    out["call"], _ = tp_collective_cost(planner_config(cfg), group)
    m = cfg.model
    out["call_group"] = group.size
    out["call_bytes"] = (m.params_dtype.itemsize * cfg.train.micro_batch_size
                         * m.seq_length * m.hidden_size)
    return out


def _time_layout(cfg, world: int, repeats: int, overhead) -> dict:
    """Build ``cfg`` on this world, one warm-up step, then ``repeats`` x (probes, one timed
    step); this rank's step seconds and probe figures per repeat."""
    import torch.distributed as dist

    from megalite.parallel.state import ParallelState
    from megalite.parallel.watchdog import RECORDER
    from megalite.training.build import build_components
    from megalite.training.loop import train_step

    ps = ParallelState.build(cfg.parallel)
    c = build_components(cfg, ps, peak_probe_seconds=0.0)
    try:
        it = c.train_iterator(0)
        num_micro = c.layout.num_microbatches
        steps, probes, comm, calls = [], [], [], []
        for i in range(repeats + 1):
            batches = [next(it) for _ in range(num_micro)]
            if i > 0:
                probes.append(_probe(cfg, world, overhead, ps))
            if world > 1:
                dist.barrier()
            blocked, issued = RECORDER.comm_seconds, dict(RECORDER.seqs)
            start = time.perf_counter()
            train_step(c, batches, i + 1)
            if world > 1:
                dist.barrier()
            if i > 0:
                steps.append(time.perf_counter() - start)
                comm.append(RECORDER.comm_seconds - blocked)
                calls.append({g: n - issued.get(g, 0) for g, n in RECORDER.seqs.items()
                              if n > issued.get(g, 0)})
    finally:
        c.close()
        ps.destroy()
    return {"steps": steps, "probes": probes, "comm": comm, "calls": calls}


def _body(rank: int, world: int, rows: list, repeats: int, base: list[str]) -> list[dict]:
    from megalite.planner.measure import OverheadProbe

    overhead = OverheadProbe(world)
    try:
        return [_time_layout(layout_config(world, flags, base), world, repeats, overhead)
                for _, _, flags in rows]
    finally:
        overhead.close()


def _run_world(world: int, rows: list, repeats: int, base: list[str]) -> list[list[dict]]:
    """Per row, the per-rank results."""
    from tools.bench import _ranks

    per_rank = _ranks.run_on_ranks(_body, world, rows, repeats, base, timeout=1800)
    return [[r[i] for r in per_rank] for i in range(len(rows))]


def cluster_of(world: int, per_rank: list[dict]):
    """The measured machine as a planner Cluster: per repeat the slowest rank's matmul
    rate and the rank means of the other figures, then the median over repeats."""
    from megalite.planner.cluster import Cluster

    repeats = len(per_rank[0]["probes"])

    def med(key, agg):
        return statistics.median(agg(r["probes"][i][key] for r in per_rank)
                                 for i in range(repeats))

    def mean(v):
        v = list(v)
        return sum(v) / len(v)

    bw = med("bw", min) if world > 1 else 1e12
    flops = med("layer_flops", min)   # a whole layer's effective rate; GEMMs alone if unusable
    flops = flops if flops == flops and flops > 0 else med("flops", min)
    latency = med("latency", mean)
    # what a collective between GEMMs costs beyond the back-to-back probe's latency and
    # bandwidth at its size
    n, size = per_rank[0]["probes"][0]["call_group"], per_rank[0]["probes"][0]["call_bytes"]
    call = med("call", mean) - ((n - 1) / n * size / bw + (n - 1) * latency) if n > 1 else 0.0
    return Cluster(gpus_per_node=world, nodes=1, gpu_memory=1e12, peak_flops=flops,
                   intra_node_bw=bw, inter_node_bw=bw, matmul_efficiency=1.0,
                   latency_s=latency, memory_bw=med("memory_bw", mean),
                   layer_overhead_s=med("layer", mean),
                   layer_forward_overhead_s=med("layer_forward", mean),
                   microbatch_overhead_s=med("microbatch", mean),
                   collective_overhead_s=max(0.0, call), name="this CPU")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation of two lists (no ties expected)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, k in enumerate(order):
            r[k] = float(i)
        return r
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def check(repeats: int = 5, names: list[str] | None = None, echo=print,
          base: list[str] | None = None) -> dict:
    """Measure and estimate every layout (or those in ``names``; over ``base``, default
    :data:`BASE_FLAGS`: a smaller model makes a quick run of the code path);
    ``{"rows": [...], "spearman": rho (nan for one layout), "max_error": e, "seconds":
    wall}``; prints the table through ``echo``."""
    base = list(BASE_FLAGS if base is None else base)
    from megalite.planner.time import estimate_time

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    layouts = [lay for lay in LAYOUTS if names is None or lay[0] in names]
    rows = []
    for world in sorted({w for _, w, _ in layouts}):
        group = [lay for lay in layouts if lay[1] == world]
        results = _run_world(world, group, repeats, base)
        for (name, _, flags), per_rank in zip(group, results):
            cluster = cluster_of(world, per_rank)
            measured = statistics.median(max(r["steps"][i] for r in per_rank)
                                         for i in range(repeats))
            t = estimate_time(planner_config(layout_config(world, flags, base)), world,
                              cluster)
            row = {"name": name, "world": world, "measured_s": measured, "estimated_s": t.step,
                   "compute_s": t.compute, "comm_s": dict(t.comm), "bubble_s": t.bubble,
                   "optimizer_s": t.optimizer,
                   "probes": {"gflops": cluster.peak_flops / 1e9,
                              "gemm_gflops": statistics.median(
                                  min(r["probes"][i]["flops"] for r in per_rank)
                                  for i in range(repeats)) / 1e9,
                              "gloo_gbps": cluster.intra_node_bw / 1e9,
                              "latency_us": cluster.latency_s * 1e6,
                              "memory_gbps": cluster.memory_bw / 1e9,
                              "layer_ms": cluster.layer_overhead_s * 1e3,
                              "microbatch_ms": cluster.microbatch_overhead_s * 1e3,
                              "call_us": cluster.collective_overhead_s * 1e6},
                   "steps_s": [max(r["steps"][i] for r in per_rank) for i in range(repeats)],
                   # seconds a rank spent blocked in collectives per step (waiting for its
                   # peers included; the flight recorder's count), rank mean, median over
                   # repeats; and the collectives each group ran per step (rank 0)
                   "blocked_s": statistics.median(
                       statistics.mean(r["comm"][i] for r in per_rank) for i in range(repeats)),
                   "calls": per_rank[0]["calls"][-1]}
            rows.append(row)
            comm = " ".join(f"{k} {v * 1e3:.0f}" for k, v in t.comm.items() if v)
            p = row["probes"]
            echo(f"{name:<13} estimated {t.step * 1e3:7.0f} ms  measured {measured * 1e3:7.0f} "
                 f"ms ({t.step / measured - 1:+5.0%})  compute {t.compute * 1e3:.0f}"
                 + (f" {comm}" if comm else "") + (f" bubble {t.bubble * 1e3:.0f}"
                                                   if t.bubble else "")
                 + f"  [{p['gflops']:.1f} GFLOP/s ({p['gemm_gflops']:.1f} GEMM), layer "
                 f"{p['layer_ms']:.2f} ms, "
                 f"mb {p['microbatch_ms']:.2f} ms"
                 + (f", gloo {p['gloo_gbps']:.2f} GB/s {p['latency_us']:.0f} us + "
                    f"{p['call_us']:.0f} us between compute" if world > 1 else "") + "]"
                 + (f"  blocked in collectives {row['blocked_s'] * 1e3:.0f} ms ("
                    + " ".join(f"{g} {n}" for g, n in sorted(row["calls"].items())) + ")"
                    if row["calls"] else ""))
    est = [r["estimated_s"] for r in rows]
    meas = [r["measured_s"] for r in rows]
    rho = spearman(est, meas) if len(rows) > 1 else float("nan")   # one layout: no ranking
    worst = max(abs(e / m - 1) for e, m in zip(est, meas))
    wall = time.perf_counter() - start
    echo(f"{len(rows)} layouts: Spearman rank correlation {rho:.3f} (>= 0.8 wanted), largest "
         f"error {worst:.0%} (<= 25% wanted); {wall:.0f} s")
    return {"rows": rows, "spearman": rho, "max_error": worst, "seconds": wall}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="benchmark.py plan-check")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layouts", nargs="*", help=f"of {[n for n, _, _ in LAYOUTS]}")
    parser.add_argument("--json", help="write the rows and figures here")
    args = parser.parse_args(argv)
    out = check(args.repeat, args.layouts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
