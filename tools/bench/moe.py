"""MoE: grouped expert GEMM vs the per-expert loop, and the bytes each dispatcher moves.

``python tools/benchmark.py moe [--tokens 4096] [--hidden-size 512] [--moe-ffn-hidden-size 1024]
[--num-experts 8] [--moe-router-topk 2] [--repeat 3] [--ranks 2 4] [--dispatch-tokens 1024]
[--fine-ranks 1 2 4] [--fine-experts 64] [--fine-topk 8] [--fine-tokens 1024]
[--fine-hidden-size 256] [--fine-ffn-hidden-size 64] [--overlap-ranks 2]
[--overlap-hidden-size 256] [--overlap-tokens 1024] [--overlap-microbatches 4]
[--overlap-layers 2] [--overlap-pp 1] [--overlap-shared-expert-size 0]``

1. Expert compute on one rank (fp32, SwiGLU experts, tokens routed by a random router):
   tokens/s of :func:`megalite.moe.experts.grouped_mlp` (padded ``torch.bmm``) against the
   Python loop over experts kept as the test reference, forward and forward + backward.
2. Dispatcher traffic: a real MoE layer with ``ep = ranks`` on gloo; the bytes every rank's
   forward collectives send to *other* ranks (``layer.dispatcher.counter``), per layer,
   against theory. Per rank with T tokens: ``T * k * h * 4`` bytes enter the all-to-all
   (the theory), of which ``(ep - 1) / ep`` leave the rank under uniform routing;
   allgather sends ``T * h * 4`` to each of the ``ep - 1`` peers whatever k. Combine moves
   the same again; backward mirrors forward and is not counted.
3. Fine-grained experts (DeepSeek-V3's shape of routing: 64 experts, top-8) at
   ``ep = 1, 2, 4`` ranks on gloo, each rank with its own tokens (dp = ep): forward +
   backward tokens/s per rank of the MoE layer against a dense SwiGLU MLP of the same
   active FLOPs (width ``top-k x expert width``) timed on the same rank in the same run, and
   the all-to-all bytes per rank and layer (dispatch + combine, forward; backward moves as
   many again) against ``2 x T * k * h * 4 * (ep - 1) / ep``. The ratio is MoE tokens/s over
   dense tokens/s: what routing, permutation, the padded grouped GEMM and the exchange
   cost over the dense layer doing the same matmul FLOPs.
4. All-to-all overlap (``--overlap-moe-expert-parallel-comm``) at ``ep = 2`` on gloo: one
   1F1B step of ``m`` micro-batches through dense + MoE layers, plain and with each
   backward paired with the next forward; the seconds ranks spend blocked on the expert
   all-to-alls (:data:`megalite.parallel.paired_lanes.STATS`) in each, and the fraction
   of the plain run's that the overlap hides. ``--overlap-pp 2`` runs it over two pipeline
   stages (``pp x ep`` ranks, the layers on each stage) and also prints the pairs each
   stage ran (``ScheduleStats.pairs``: ``m - pp + stage``). On a CPU whose cores also run
   gloo's threads the numbers only indicate; take them on a quiet machine.
   ``--overlap-shared-expert-size F`` gives the MoE layers shared experts of width F and
   adds a third variant, ``--moe-shared-expert-overlap`` (unpaired): the shared experts'
   forward runs while each forward dispatch all-to-all is in flight.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from tools.bench import _ranks


def _model_cfg(args, dispatcher="alltoall"):
    from megalite.config import ModelConfig

    return ModelConfig(hidden_size=args.hidden_size, num_experts=args.num_experts,
                       moe_router_topk=args.moe_router_topk,
                       moe_ffn_hidden_size=args.moe_ffn_hidden_size, swiglu=True,
                       add_bias_linear=False, init_method_std=0.02,
                       moe_token_dispatcher_type=dispatcher)


def _timed_interleaved(fns, reps):
    """Best-of-``reps`` seconds of each function, alternating between them so that load
    from other processes drifts over all of them alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def bench_experts(args) -> dict:
    """Print the expert-compute table; return the seconds per path and pass,
    ``{(path, "forward" | "forward+backward"): seconds}``."""
    from megalite.config import ParallelConfig
    from megalite.moe.dispatcher import permute
    from megalite.moe.experts import grouped_mlp
    from megalite.moe.layer import MoELayer
    from megalite.parallel.state import ParallelState
    from tests.moe.reference import expert_loop

    torch.manual_seed(0)
    layer = MoELayer(_model_cfg(args), ParallelState.build(ParallelConfig()), 0, seed=1)
    x = torch.randn(args.tokens, 1, args.hidden_size)
    with torch.no_grad():
        routing = layer.router(x)
    tokens, _, _, counts = permute(x.view(-1, args.hidden_size), routing.probs,
                                   routing.routing_map)
    fc1, fc2 = layer.experts.fc1, layer.experts.fc2
    grad = torch.randn_like(tokens)
    inp = tokens.clone().requires_grad_(True)
    print(f"expert compute: E={args.num_experts} k={args.moe_router_topk} h={args.hidden_size} "
          f"ffn={args.moe_ffn_hidden_size} SwiGLU, {args.tokens} tokens -> {tokens.shape[0]} "
          f"expert rows, "
          f"fp32, {torch.get_num_threads()} threads; rows per expert min/max "
          f"{int(counts.min())}/{int(counts.max())}")
    print(f"{'path':<28} {'fwd tok/s':>11} {'fwd+bwd tok/s':>14} {'fwd ms':>9} {'f+b ms':>9}")
    paths = (("per-expert loop (reference)", expert_loop),
             ("grouped GEMM (padded bmm)", grouped_mlp))

    def fwd(fn):
        with torch.no_grad():
            fn(tokens, counts, fc1, fc2, swiglu=True)

    def fwd_bwd(fn):
        out = fn(inp, counts, fc1, fc2, swiglu=True)
        torch.autograd.backward(out, grad)
        inp.grad = fc1.grad = fc2.grad = None

    t_f = _timed_interleaved([lambda fn=fn: fwd(fn) for _, fn in paths], args.repeat)
    t_fb = _timed_interleaved([lambda fn=fn: fwd_bwd(fn) for _, fn in paths], args.repeat)
    for (name, _), f, fb in zip(paths, t_f, t_fb):
        print(f"{name:<28} {args.tokens / f:>11.0f} {args.tokens / fb:>14.0f} "
              f"{f * 1e3:>9.1f} {fb * 1e3:>9.1f}")
    print(f"grouped / loop speed-up: forward {t_f[0] / t_f[1]:.2f}x, forward+backward "
          f"{t_fb[0] / t_fb[1]:.2f}x (best of {args.repeat}, interleaved)")
    return {**{(name, "forward"): f for (name, _), f in zip(paths, t_f)},
            **{(name, "forward+backward"): fb for (name, _), fb in zip(paths, t_fb)}}


def _dispatch_on_rank(rank, world, args):
    from megalite.config import ParallelConfig
    from megalite.moe.layer import MoELayer
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(expert_model_parallel_size=world))
    results = {}
    for dispatcher in ("alltoall", "allgather"):
        layer = MoELayer(_model_cfg(args, dispatcher), ps, 0, seed=1)
        x = torch.randn(args.dispatch_tokens, 1, args.hidden_size,
                        generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            layer(x)  # warm-up
            layer.dispatcher.counter.reset()
            dist.barrier()
            t0 = time.perf_counter()
            layer(x)
            elapsed = time.perf_counter() - t0
        results[dispatcher] = (dict(layer.dispatcher.counter.sent), elapsed)
    ps.destroy()
    return results


def bench_dispatchers(args) -> dict:
    """Print the dispatcher table; return ``{(ranks, dispatcher): {"dispatch", "combine",
    "metadata", "theory"}}``, mean bytes sent per rank."""
    T, h, k, E = args.dispatch_tokens, args.hidden_size, args.moe_router_topk, args.num_experts
    print(f"\ndispatcher bytes per MoE layer forward (sent to other ranks, mean per rank), "
          f"T={T} tokens/rank, h={h}, k={k}, E={E}, fp32")
    print(f"{'ranks':>5} {'dispatcher':>10} {'dispatch':>11} {'combine':>11} {'metadata':>9} "
          f"{'theory T*k*h*4':>15} {'x (ep-1)/ep':>12} {'dispatch/theory':>16} {'fwd ms':>8}")
    rows = {}
    for world in args.ranks:
        by_rank = _ranks.run_on_ranks(_dispatch_on_rank, world, args)
        full = T * k * h * 4
        leaving = full * (world - 1) / world
        for dispatcher in ("alltoall", "allgather"):
            sent = [by_rank[r][dispatcher][0] for r in range(world)]
            ms = max(by_rank[r][dispatcher][1] for r in range(world)) * 1e3
            mean = {key: sum(s.get(key, 0) for s in sent) / world
                    for key in {key for s in sent for key in s}}
            meta = sum(v for key, v in mean.items() if key not in ("dispatch", "combine"))
            theory = leaving if dispatcher == "alltoall" else T * h * 4 * (world - 1)
            rows[(world, dispatcher)] = {"dispatch": mean["dispatch"],
                                         "combine": mean["combine"], "metadata": meta,
                                         "theory": theory}
            print(f"{world:>5} {dispatcher:>10} {mean['dispatch']:>11.0f} "
                  f"{mean['combine']:>11.0f} {meta:>9.0f} {full:>15} {leaving:>12.0f} "
                  f"{mean['dispatch'] / theory:>16.3f} {ms:>8.1f}")
    print("dispatch/theory: alltoall against T*k*h*4*(ep-1)/ep (uniform routing), allgather "
          "against T*h*4*(ep-1); metadata = counts (alltoall) or probs + routing map "
          "(allgather)")
    return rows


def _fine_cfg(args):
    from megalite.config import ModelConfig

    return ModelConfig(hidden_size=args.fine_hidden_size, num_experts=args.fine_experts,
                       moe_router_topk=args.fine_topk,
                       moe_ffn_hidden_size=args.fine_ffn_hidden_size, swiglu=True,
                       add_bias_linear=False, init_method_std=0.02, num_layers=2)


def _best_fwd_bwd(module, x, grad, reps, group=None) -> float:
    """Best-of-``reps`` seconds of ``module(x)`` forward + backward (a barrier over the
    world before each, so that ranks start together)."""
    best = float("inf")
    for i in range(reps + 1):   # the first is a warm-up
        if group is not None:
            dist.barrier()
        t0 = time.perf_counter()
        module(x).backward(grad)
        elapsed = time.perf_counter() - t0
        module.zero_grad(set_to_none=True)
        if i:
            best = min(best, elapsed)
    return best


def _fine_on_rank(rank, world, args):
    from megalite.config import ParallelConfig
    from megalite.moe.layer import MoELayer, SharedExpertMLP
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(expert_model_parallel_size=world))
    cfg = _fine_cfg(args)
    T, h = args.fine_tokens, args.fine_hidden_size
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, 1, h, generator=gen)
    grad = torch.randn(T, 1, h, generator=gen)
    layer = MoELayer(cfg, ps, 0, seed=1)
    dense = SharedExpertMLP(cfg, args.fine_topk * args.fine_ffn_hidden_size, ps)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    layer.dispatcher.counter.reset()
    layer(x)   # one forward: its bytes
    sent = dict(layer.dispatcher.counter.sent)
    t_moe = _best_fwd_bwd(layer, x, grad, args.repeat, group=ps.ep if world > 1 else None)
    t_dense = _best_fwd_bwd(dense, x, grad, args.repeat)
    ps.destroy()
    return {"moe": t_moe, "dense": t_dense, "a2a": sent.get("dispatch", 0)
            + sent.get("combine", 0), "metadata": sent.get("counts", 0)}


def bench_fine_grained(args) -> dict:
    """Print the fine-grained table; return ``{ep: {"moe_tokens_per_s", "dense_tokens_per_s",
    "ratio", "a2a_bytes", "theory"}}`` (per rank; bytes of one layer's forward)."""
    T, h, k, E = (args.fine_tokens, args.fine_hidden_size, args.fine_topk, args.fine_experts)
    f = args.fine_ffn_hidden_size
    print(f"\nfine-grained experts: E={E} top-{k}, h={h}, expert ffn={f} SwiGLU vs a dense "
          f"SwiGLU MLP of ffn {k * f} (same active matmul FLOPs; the router's E*h per token "
          f"aside), T={T} tokens per rank, fp32, forward+backward, best of {args.repeat}")
    print(f"{'ep':>3} {'MoE tok/s':>10} {'dense tok/s':>12} {'MoE/dense':>10} "
          f"{'a2a bytes fwd':>14} {'theory':>12} {'counts B':>9}")
    rows = {}
    for world in args.fine_ranks:
        by_rank = _ranks.run_on_ranks(_fine_on_rank, world, args)
        moe = T / max(r["moe"] for r in by_rank)      # the slowest rank sets the pace
        dense = T / sum(r["dense"] for r in by_rank) * world   # mean over ranks
        a2a = sum(r["a2a"] for r in by_rank) / world
        meta = sum(r["metadata"] for r in by_rank) / world
        theory = 2 * T * k * h * 4 * (world - 1) / world   # dispatch + combine
        rows[world] = {"moe_tokens_per_s": moe, "dense_tokens_per_s": dense,
                       "ratio": moe / dense, "a2a_bytes": a2a, "theory": theory}
        print(f"{world:>3} {moe:>10.0f} {dense:>12.0f} {moe / dense:>10.2f} {a2a:>14.0f} "
              f"{theory:>12.0f} {meta:>9.0f}")
    print("MoE/dense: tokens/s of the MoE layer over the dense MLP's on the same ranks; "
          "theory: 2 x T*k*h*4*(ep-1)/ep (uniform routing)")
    return rows


class _OverlapModel(torch.nn.Module):
    """``layers`` x (a dense SwiGLU MLP standing in for attention, then an MoE layer),
    residual: the compute of one micro-batch between its expert all-to-alls."""

    def __init__(self, cfg, ps, layers: int, ffn: int):
        from megalite.moe.layer import MoELayer, SharedExpertMLP

        super().__init__()
        self.dense = torch.nn.ModuleList(SharedExpertMLP(cfg, ffn, ps) for _ in range(layers))
        self.moe = torch.nn.ModuleList(MoELayer(cfg, ps, i, seed=1) for i in range(layers))

    def forward(self, x):
        for dense, moe in zip(self.dense, self.moe):
            x = x + dense(x)
            x = x + moe(x)
        return x


def _overlap_on_rank(rank, world, args):
    from megalite.config import ModelConfig, ParallelConfig
    from megalite.parallel import paired_lanes
    from megalite.parallel.state import ParallelState
    from megalite.pipeline.p2p import PipeComm
    from megalite.pipeline.schedules import ScheduleStats, build_schedules, run_schedule

    pp = args.overlap_pp
    ps = ParallelState.build(ParallelConfig(expert_model_parallel_size=world // pp,
                                            pipeline_model_parallel_size=pp))
    h, m = args.overlap_hidden_size, args.overlap_microbatches
    cfg = ModelConfig(hidden_size=h, num_experts=2 * ps.ep.size, moe_router_topk=2,
                      moe_ffn_hidden_size=2 * h, swiglu=True, add_bias_linear=False,
                      init_method_std=0.02, num_layers=args.overlap_layers,
                      moe_shared_expert_intermediate_size=args.overlap_shared_expert_size
                      or None)
    model = _OverlapModel(cfg, ps, args.overlap_layers, 4 * h)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.overlap_tokens, 1, h, generator=gen) for _ in range(m)]
    steps = build_schedules(pp, m)
    comm = PipeComm(ps, (args.overlap_tokens, 1, h), torch.float32) if pp > 1 else None
    last = ps.pp.rank == pp - 1
    pairs = {}

    def forward_step(chunk, mb, received):
        y = model(xs[mb] if received is None else received)
        return y.square().mean() if last else y

    def step(variant: str):
        paired = variant == "overlap"
        for layer in model.moe:   # --moe-shared-expert-overlap, as the config would set it
            layer.shared_overlap = variant == "shared"
        stats = ScheduleStats()
        run_schedule(steps, forward_step=forward_step, ps=ps, vpp=1, comm=comm,
                     pair_backward_forward=paired, stats=stats)
        model.zero_grad(set_to_none=True)
        pairs[variant] = stats.pairs

    out = {}
    variants = _overlap_variants(args)
    for variant in variants:   # warm-up
        step(variant)
    totals = {v: [0.0, 0.0, 0.0, 0, 0] for v in variants}
    best = {v: float("inf") for v in variants}
    for _ in range(args.repeat):
        for variant in variants:   # alternate: load from elsewhere drifts over all
            dist.barrier()
            paired_lanes.STATS.reset()
            t0 = time.perf_counter()
            step(variant)
            elapsed = time.perf_counter() - t0
            best[variant] = min(best[variant], elapsed)
            st, tot = paired_lanes.STATS, totals[variant]
            tot[0] += elapsed
            tot[1] += st.blocked
            tot[2] += st.span
            tot[3] += st.calls
            tot[4] += st.overlapped
    for variant in variants:
        wall, blocked, span, calls, overlapped = totals[variant]
        out[variant] = {"step_s": best[variant], "blocked_s": blocked / args.repeat,
                        "span_s": span / args.repeat, "calls": calls // args.repeat,
                        "overlapped": overlapped // args.repeat, "pairs": pairs[variant]}
    out["stage"] = ps.pp.rank
    ps.destroy()
    return out


def _overlap_variants(args) -> tuple[str, ...]:
    """plain, overlap (paired lanes), and shared (--moe-shared-expert-overlap) when the
    MoE layers have shared experts."""
    return ("plain", "overlap") + (("shared",) if args.overlap_shared_expert_size else ())


def bench_overlap(args) -> dict:
    """``--overlap-moe-expert-parallel-comm`` on ``ep = ranks``: one 1F1B step of
    ``m`` micro-batches with and without each backward paired with the next forward.
    Print and return ``{ep: {"plain": ..., "overlap": ..., "hidden_fraction": ...}}``, each
    variant's ``step_s`` (best of ``--repeat``), ``blocked_s`` (seconds ranks spent waiting
    on expert all-to-alls per step: the exposed communication), ``span_s`` (issue to
    completion, summed), ``calls`` and ``overlapped`` (all-to-alls issued inside a pair
    while the other lane was alive); the slowest rank's numbers. The hidden fraction is
    ``1 - blocked(overlap) / blocked(plain)``: the share of the plain run's all-to-all time
    that the overlap took off the critical path. Only pairs overlap: the first forward
    and the last backward of a step are alone, so at most ``(m - 1) / m`` can hide (on
    stage ``s`` of ``--overlap-pp`` stages ``m - pp + s`` backwards pair: its warm-up
    forwards have no partner either). With ``--overlap-pp`` above 1 the ranks are
    ``pp x ep`` and ``pairs_by_stage`` lists the pairs each stage ran. With
    ``--overlap-shared-expert-size`` the row has a third variant, ``shared``
    (``--moe-shared-expert-overlap``, not paired: ``overlapped`` counts the forward
    dispatches that ran the shared experts while in flight), and ``shared_hidden_fraction``
    ``1 - blocked(shared) / blocked(plain)``."""
    h, T, m = args.overlap_hidden_size, args.overlap_tokens, args.overlap_microbatches
    pp = args.overlap_pp
    print(f"\nall-to-all overlap (--overlap-moe-expert-parallel-comm): {args.overlap_layers} "
          f"x (dense MLP + MoE layer){' per stage' if pp > 1 else ''}, h={h}, T={T} tokens "
          f"per micro-batch and rank, {m} micro-batches, 1F1B over {pp} pipeline "
          "stage(s), fp32, forward+backward; slowest rank"
          + (f"; shared experts of width {args.overlap_shared_expert_size}"
             if args.overlap_shared_expert_size else ""))
    print(f"{'ep':>3} {'variant':>8} {'step ms':>9} {'a2a blocked ms':>15} "
          f"{'a2a span ms':>12} {'a2a calls':>10} {'overlapped':>11} {'hidden':>7}")
    rows = {}
    for world in args.overlap_ranks:
        by_rank = _ranks.run_on_ranks(_overlap_on_rank, world * pp, args)
        row = {}
        names = _overlap_variants(args)
        for name in names:
            row[name] = {key: max(r[name][key] for r in by_rank)
                         for key in ("step_s", "blocked_s", "span_s", "calls", "overlapped")}
            row[name]["pairs_by_stage"] = [max(r[name]["pairs"] for r in by_rank
                                               if r["stage"] == s) for s in range(pp)]
        plain = row["plain"]["blocked_s"]
        row["hidden_fraction"] = 1.0 - row["overlap"]["blocked_s"] / plain if plain else 0.0
        if "shared" in row:
            row["shared_hidden_fraction"] = (1.0 - row["shared"]["blocked_s"] / plain
                                             if plain else 0.0)
        rows[world] = row
        fraction = {"overlap": "hidden_fraction", "shared": "shared_hidden_fraction"}
        for name in names:
            v = row[name]
            hidden = (f"{row[fraction[name]]:>7.2f}" if name in fraction else f"{'':>7}")
            print(f"{world:>3} {name:>8} {v['step_s'] * 1e3:>9.1f} {v['blocked_s'] * 1e3:>15.2f} "
                  f"{v['span_s'] * 1e3:>12.2f} {v['calls']:>10} {v['overlapped']:>11} {hidden}")
        if pp > 1:
            print(f"    pairs run per pipeline stage: {row['overlap']['pairs_by_stage']}")
    print("hidden: 1 - a2a blocked (overlap or shared) / a2a blocked (plain); blocked: time "
          "waiting on the expert all-to-alls per step; shared: --moe-shared-expert-overlap")
    return rows


def main(argv=None) -> dict:
    """Print the tables; return their rows, ``{"experts": ..., "dispatchers": ...,
    "fine_grained": ..., "overlap": ...}``."""
    parser = argparse.ArgumentParser(prog="benchmark.py moe")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--dispatch-tokens", type=int, default=1024)
    parser.add_argument("--skip-compute", action="store_true")
    parser.add_argument("--fine-ranks", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--fine-experts", type=int, default=64)
    parser.add_argument("--fine-topk", type=int, default=8)
    parser.add_argument("--fine-tokens", type=int, default=1024)
    parser.add_argument("--fine-hidden-size", type=int, default=256)
    parser.add_argument("--fine-ffn-hidden-size", type=int, default=64)
    parser.add_argument("--overlap-ranks", type=int, nargs="*", default=[2])
    parser.add_argument("--overlap-hidden-size", type=int, default=256)
    parser.add_argument("--overlap-tokens", type=int, default=1024)
    parser.add_argument("--overlap-microbatches", type=int, default=4)
    parser.add_argument("--overlap-layers", type=int, default=2)
    parser.add_argument("--overlap-pp", type=int, default=1,
                        help="pipeline stages of the overlap section (ranks: pp x ep)")
    parser.add_argument("--overlap-shared-expert-size", type=int, default=0,
                        help="shared experts of this width in the overlap section's MoE "
                             "layers, and a variant with --moe-shared-expert-overlap")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return {"experts": bench_experts(args) if not args.skip_compute else {},
            "dispatchers": bench_dispatchers(args) if args.ranks else {},
            "fine_grained": bench_fine_grained(args) if args.fine_ranks else {},
            "overlap": bench_overlap(args) if args.overlap_ranks else {}}

