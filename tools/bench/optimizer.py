"""Optimizer step time and bytes: AdamW, SGD, Muon and Lion on one process.

``python tools/benchmark.py optimizer [--num-layers 4] [--hidden-size 512]
[--ffn-hidden-size 1408] [--vocab-size 8192] [--muon-num-ns-steps 5] [--repeat 5]``

One process builds a Llama-style GPT (GQA with 4 query groups, SwiGLU, RMSNorm, fp32)
once per ``--optimizer``, gives every parameter a random gradient and times
:meth:`MixedPrecisionOptimizer.step` (median of ``--repeat`` after one warm-up step).
Bytes: the optimizer's state as :func:`megalite.optim.memory.rank_memory` measures it, per
parameter (AdamW 8: two fp32 moments; SGD 4; Muon 4 for the matrices' momentum and Lion 4
for their exp_avg, each 8 for the rest (AdamW), which the row's ``matrices`` fraction
weighs). For Muon also the Newton-Schulz
FLOPs of one step (:func:`megalite.optim.newton_schulz.ns_flops` of every matrix, Q, K, V
apart) and the rate they ran at; the reference is AdamW's step in the same run.

Communication (``--comm-layouts 1x1 2x1 4x1 1x2 2x2 4x2``, each ``DPxTP``, on fresh gloo
ranks; ``--comm-layouts`` with no value skips it): the same model, AdamW and Muon, with and
without the distributed optimizer (with only at dp > 1), one step from random gradients.
Every collective of the gradient sync (``DataParallelGrads.finish_grad_sync``) and of the
step (``optimizer.step`` and its parameter all-gather) is counted by the bytes this rank
puts on the wire under ring algorithms (:class:`CommBytes`: all-reduce ``2 (n-1)/n`` of the
tensor, all-gather ``n-1`` times the input, reduce-scatter ``(n-1)/n`` of the input,
all-to-all what leaves for other ranks), mean per rank, against theory with ``P`` this
rank's parameters (its tp shard), ``M`` those of its Muon matrices, ``T`` those of its
Muon matrices split over tp, ``D = dp``, fp32:

* reduce-scatter of the gradients and all-gather of the parameters (distributed
  optimizer): ``4 P (D-1)/D`` each (buckets padded to a multiple of ``D``: a hair more);
* Muon's tp gather (``--muon-tp-mode duplicated``: each matrix's shards to its owner tp
  rank and back): ``2 * 4 T (tp-1)/tp``, on every dp replica without the distributed
  optimizer, on the matrix's owner dp rank only with it (``/ D``);
* Muon's owner exchange (distributed optimizer: each matrix's pieces to its owner dp rank
  and the result back): ``2 * 4 X / D`` with ``X`` the elements of this tp rank's Muon
  matrices that the dp group's shards hold outside each matrix's owner (read from the
  bucket layout and the owners); pieces spread evenly over the shards would make it
  ``2 * 4 M (D-1)/D^2``, but contiguous buckets keep much of a matrix in one or two
  shards, so it is less (0.7 and 0.33 of that on the test's tiny model at dp 2 and 4);
* the rest (the inf/nan check and the norm's scalars): a few bytes.

``--fp8-param-gather`` (the ``adam-fp8`` case, distributed only): the model in bf16 with
tensorwise fp8 linears, one bucket per parameter (no weight shares a rank's packed row with
another parameter), AdamW. The parameter all-gather sends the ``P8`` elements of the fp8
linears' weights as one byte each and the rest in bf16: ``(2 (P - P8) + P8) (D-1)/D``,
where bf16 would send ``2 P (D-1)/D``, so the fp8 weights' part is halved; plus the amax
MAX of each fp8 weight over dp (a scalar each, "other").

Without the distributed optimizer the gradient all-reduce of data parallelism is the only
large collective (``2 * 4 P (D-1)/D``, in the gradient sync), AdamW's step moves nothing.
Counts are deterministic. A second table gives each case's step time on those ranks
(gradient sync and step, median of ``--repeat``, the slowest rank) and Muon's against
AdamW's at the same layout; the ranks share the machine's cores, so quote it only from a
quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from tools.bench import _ranks


def _model(args, tp: int = 1, fp8: bool = False):
    from megalite.config import ModelConfig, ParallelConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel.state import ParallelState

    extra = ({"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "tensorwise",
              "fp8_param_gather": True} if fp8 else {})
    cfg = ModelConfig(**extra,
                      num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size,
                      num_attention_heads=max(4, args.hidden_size // 64),
                      group_query_attention=True, num_query_groups=4, swiglu=True,
                      normalization="RMSNorm", position_embedding_type="rope",
                      add_bias_linear=False, seq_length=128, vocab_size=args.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa")
    ps = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp))
    return GPTModel(cfg, ps, seed=1), ps


def _measure(args, optimizer: str) -> dict:
    from megalite.config import OptimConfig
    from megalite.optim.algorithms.muon import is_matrix
    from megalite.optim.loss_scaler import build_loss_scaler
    from megalite.optim.memory import rank_memory
    from megalite.optim.muon_layout import matrices
    from megalite.optim.optimizer import MixedPrecisionOptimizer

    extra = {"muon_num_ns_steps": args.muon_num_ns_steps} if optimizer == "muon" else {}
    ocfg = OptimConfig(optimizer=optimizer, lr=1e-3, clip_grad=0.0, **extra)
    model, ps = _model(args)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, generator=gen)
    opt = MixedPrecisionOptimizer(model, ocfg, ps, build_loss_scaler(ocfg, False))
    times = []
    for step in range(args.repeat + 1):
        start = time.perf_counter()
        opt.step()
        if step:
            times.append(time.perf_counter() - start)

    class _NoGrads:
        def memory_tensors(self):
            return []

    memory = rank_memory(model, _NoGrads(), opt)
    named = list(model.named_parameters())
    in_matrices = sum(p.numel() for n, p in named if is_matrix(n, p))
    flops = sum(m.cost(args.muon_num_ns_steps) for m in matrices(
        [(n, p) for n, p in named if is_matrix(n, p)], ps, ocfg)) if optimizer == "muon" \
        else 0.0
    return {"step": statistics.median(times), "bytes": memory.optimizer / memory.num_params,
            "matrices": in_matrices / memory.num_params, "ns_flops": flops}


class CommBytes:
    """Bytes this rank sends per collective while active (see module docstring), by
    ``(op, group name)``: wraps :mod:`megalite.parallel.collectives`' two entry points."""

    def __init__(self):
        self.sent: dict[tuple[str, str], float] = {}

    @staticmethod
    def _bytes(group, name: str, args: tuple, kwargs: dict) -> float:
        from megalite.parallel import collectives

        n = collectives.world_size() if group is None else group.size
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name == "all_reduce":
            t = tensors[0]
            return 2 * (n - 1) / n * t.numel() * t.element_size()
        if name not in ("all_gather", "reduce_scatter", "all_to_all"):
            return 0.0
        x = tensors[-1]
        size = x.numel() * x.element_size()
        if name == "all_gather":
            return (n - 1) * size
        if name == "reduce_scatter":
            return (n - 1) / n * size
        splits = kwargs.get("input_split_sizes")
        if splits is None:
            return (n - 1) / n * size
        row = size / max(1, sum(splits))
        return size - splits[group.rank] * row

    @contextmanager
    def counting(self, label: str):
        """Count the collectives issued inside under ``(op, group)`` keys of ``label``."""
        from megalite.parallel import collectives

        sync, launch = collectives._sync, collectives._launch

        def record(group, name, args, kwargs):
            key = (label, name, "world" if group is None else group.name)
            self.sent[key] = self.sent.get(key, 0.0) + self._bytes(group, name, args, kwargs)

        def counted_sync(group, name, fn, /, *args, **kwargs):
            record(group, name, args, kwargs)
            return sync(group, name, fn, *args, **kwargs)

        def counted_launch(group, name, fn, /, *args, **kwargs):
            record(group, name, args, kwargs)
            return launch(group, name, fn, *args, **kwargs)

        collectives._sync, collectives._launch = counted_sync, counted_launch
        try:
            yield self
        finally:
            collectives._sync, collectives._launch = sync, launch


def _comm_on_rank(rank, world, args, tp, cases):
    """Every ``(optimizer, distributed)`` case on this rank of a ``dp x tp`` world: the
    bytes of the gradient sync and of the step, and this rank's P, M, T."""
    from megalite.config import OptimConfig
    from megalite.optim.algorithms import algorithm_of
    from megalite.optim.data_parallel import DataParallelGrads
    from megalite.optim.distributed_optimizer import DistributedOptimizer
    from megalite.optim.loss_scaler import build_loss_scaler
    from megalite.optim.optimizer import MixedPrecisionOptimizer
    from megalite.parallel.params import param_meta

    from megalite.optim.fp8_param_gather import fp8_weight_scalings

    out = {}
    for case in cases:
        optimizer, distributed = case
        fp8 = optimizer == "adam-fp8"
        extra = {"muon_num_ns_steps": args.muon_num_ns_steps} if optimizer == "muon" else {}
        ocfg = OptimConfig(optimizer="adam" if fp8 else optimizer, lr=1e-3, clip_grad=1.0,
                           **extra)
        model, ps = _model(args, tp, fp8)
        grads = DataParallelGrads(model, ps, bucket_size=1 if fp8 else None,
                                  use_distributed_optimizer=distributed,
                                  fp8_param_gather=fp8)
        scaler = build_loss_scaler(ocfg, False)
        opt = (DistributedOptimizer(model, ocfg, ps, scaler, grads) if distributed
               else MixedPrecisionOptimizer(model, ocfg, ps, scaler))
        gen = torch.Generator().manual_seed(rank)
        for buf in grads.buffers:
            buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
        counter = CommBytes()
        with counter.counting("grad sync"):
            grads.finish_grad_sync()
        with counter.counting("step"):
            opt.step()
            grads.wait_param_sync()   # (finish_param_sync would regather fp8 weights in bf16)
        times = []
        for _ in range(args.repeat):   # the same step, timed: gradient sync + step
            for buf in grads.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen))
            torch.distributed.barrier()
            start = time.perf_counter()
            grads.finish_grad_sync()
            opt.step()
            grads.wait_param_sync()
            times.append(time.perf_counter() - start)
        named = list(model.named_parameters())
        alg = algorithm_of(ocfg)
        muon = [p for n, p in named if optimizer == "muon" and alg.rule(ocfg, n, p) == "muon"]
        sizes = {"P": sum(p.numel() for _, p in named), "M": sum(p.numel() for p in muon),
                 "T": sum(p.numel() for p in muon if param_meta(p).tensor_parallel),
                 "X": _outside_owner(getattr(opt, "exchange", None)),
                 "P8": sum(p.numel() for p in model.parameters()
                           if id(p) in fp8_weight_scalings([model])),
                 "bytes": 2 if fp8 else 4}
        out[case] = (counter.sent, sizes, statistics.median(times))
        grads.remove_hooks()
        ps.destroy()
    return out


def _outside_owner(exchange) -> int:
    """Elements of this rank's Muon matrices (its tp shards) that the distributed
    optimizer's shards hold on ranks other than the matrix's owner, summed over the
    data-parallel group's shards: what the owner exchange sends there (and back)."""
    if exchange is None:
        return 0
    total = 0
    for group, buckets, owner in exchange.groups:
        for bucket, members in buckets:
            for r in range(group.size):
                lo, hi = bucket.shard_range(r)
                total += sum(max(0, min(b, hi) - max(a, lo)) for p, (a, b) in members
                             if owner[id(p)] != r)
    return total


def _theory(kind: str, sizes: dict, dp: int, tp: int, distributed: bool) -> float:
    P, T, X, P8 = sizes["P"], sizes["T"], sizes["X"], sizes["P8"]
    if kind == "grad all-reduce":
        return 0.0 if distributed else 2 * 4 * P * (dp - 1) / dp
    if kind == "grad reduce-scatter":
        return 4 * P * (dp - 1) / dp if distributed else 0.0
    if kind == "param all-gather":   # fp8 linears' weights at one byte (--fp8-param-gather)
        return (sizes["bytes"] * (P - P8) + P8) * (dp - 1) / dp if distributed else 0.0
    if kind == "muon tp gather":
        return 2 * 4 * T * (tp - 1) / tp / (dp if distributed else 1)
    if kind == "muon owner exchange":
        return 2 * 4 * X / dp if distributed else 0.0
    return 0.0


KINDS = ("grad all-reduce", "grad reduce-scatter", "param all-gather", "muon tp gather",
         "muon owner exchange", "other")


def _kind(phase: str, op: str, group: str) -> str:
    if phase == "grad sync" and op == "all_reduce" and group == "dp_cp":
        return "grad all-reduce"
    if op == "reduce_scatter":
        return "grad reduce-scatter"
    if op == "all_gather" and phase == "step":
        return "param all-gather"
    if op == "all_to_all":
        return "muon tp gather" if group in ("tp", "etp") else "muon owner exchange"
    return "other"


def bench_comm(args) -> dict:
    """Print the communication and step-time tables; return ``{(dp, tp, optimizer,
    distributed): {kind: (measured bytes, theory bytes)}}`` (mean per rank, one step) and
    under ``"step_s"`` the same keys' step seconds (slowest rank)."""
    rows, steps = {}, {}
    if not args.comm_layouts:
        return rows
    print(f"\noptimizer communication per step (bytes sent per rank, mean over ranks, "
          f"fp32; adam-fp8: bf16 with --fp8-param-gather): {args.num_layers} layers, "
          f"hidden {args.hidden_size}")
    print(f"{'dp':>3} {'tp':>3} {'optimizer':>10} {'distopt':>8} {'kind':>20} "
          f"{'measured':>12} {'theory':>12} {'ratio':>7}")
    for layout in args.comm_layouts:
        dp, tp = (int(x) for x in layout.split("x"))
        cases = [(o, d) for o in ("adam", "muon") for d in ((False, True) if dp > 1
                                                             else (False,))]
        cases += [("adam-fp8", True)] if dp > 1 else []
        by_rank = _ranks.run_on_ranks(_comm_on_rank, dp * tp, args, tp, cases)
        for case in cases:
            measured = dict.fromkeys(KINDS, 0.0)
            for sent, _, _ in (r[case] for r in by_rank):
                for (phase, op, group), nbytes in sent.items():
                    measured[_kind(phase, op, group)] += nbytes / (dp * tp)
            sizes = by_rank[0][case][1]
            row = {k: (measured[k], _theory(k, sizes, dp, tp, case[1])) for k in KINDS}
            rows[(dp, tp, *case)] = row
            steps[(dp, tp, *case)] = max(r[case][2] for r in by_rank)   # slowest rank
            for kind, (got, want) in row.items():
                if got or want:
                    ratio = f"{got / want:>7.3f}" if want else f"{'-':>7}"
                    print(f"{dp:>3} {tp:>3} {case[0]:>10} {str(case[1]):>8} {kind:>20} "
                          f"{got:>12.0f} {want:>12.0f} {ratio}")
    print(f"\noptimizer step time on gloo ranks (gradient sync + step, median of {args.repeat}, "
          "slowest rank; ranks share this machine's cores)")
    print(f"{'dp':>3} {'tp':>3} {'optimizer':>10} {'distopt':>8} {'step ms':>9} {'vs adam':>8}")
    for (dp, tp, optimizer, distributed), sec in steps.items():
        ref = steps.get((dp, tp, "adam", distributed))
        ratio = f"{sec / ref:8.2f}" if ref else f"{'-':>8}"
        print(f"{dp:>3} {tp:>3} {optimizer:>10} {str(distributed):>8} {sec * 1e3:9.1f} {ratio}")
    rows["step_s"] = steps
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="benchmark.py optimizer")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--ffn-hidden-size", type=int, default=1408)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--muon-num-ns-steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--comm-layouts", nargs="*", default=["1x1", "2x1", "4x1", "1x2", "2x2",
                                                          "4x2"],
                    help="DPxTP layouts of the communication table (none: skip it)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = {name: _measure(args, name) for name in ("adam", "sgd", "muon", "lion")}
    ref = rows["adam"]["step"]
    print(f"{'optimizer':<10}{'step ms':>10}{'vs adam':>9}{'bytes/param':>13}"
          f"{'matrices':>10}{'NS GFLOP':>10}{'NS GFLOP/s':>12}")
    for name, r in rows.items():
        rate = r["ns_flops"] / r["step"] / 1e9 if r["ns_flops"] else 0.0
        print(f"{name:<10}{r['step'] * 1e3:>10.2f}{r['step'] / ref:>9.2f}"
              f"{r['bytes']:>13.2f}{r['matrices']:>10.2%}{r['ns_flops'] / 1e9:>10.3f}"
              f"{rate:>12.1f}")
    rows["comm"] = bench_comm(args)
    return rows
