"""Optimizer step time and bytes: AdamW, SGD and Muon on one process.

``python tools/benchmark.py optimizer [--num-layers 4] [--hidden-size 512]
[--ffn-hidden-size 1408] [--vocab-size 8192] [--muon-num-ns-steps 5] [--repeat 5]``

One process builds a Llama-style GPT (GQA with 4 query groups, SwiGLU, RMSNorm, fp32)
once per ``--optimizer``, gives every parameter a random gradient and times
:meth:`MixedPrecisionOptimizer.step` (median of ``--repeat`` after one warm-up step).
Bytes: the optimizer's state as :func:`megalite.optim.memory.rank_memory` measures it, per
parameter (AdamW 8: two fp32 moments; SGD 4; Muon 4 for the matrices' momentum and 8 for
the rest, which the row's ``matrices`` fraction weighs). For Muon also the Newton-Schulz
FLOPs of one step (:func:`megalite.optim.newton_schulz.ns_flops` of every matrix, Q, K, V
apart) and the rate they ran at; the reference is AdamW's step in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model(args):
    from megalite.config import ModelConfig, ParallelConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel.state import ParallelState

    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size,
                      num_attention_heads=max(4, args.hidden_size // 64),
                      group_query_attention=True, num_query_groups=4, swiglu=True,
                      normalization="RMSNorm", position_embedding_type="rope",
                      add_bias_linear=False, seq_length=128, vocab_size=args.vocab_size,
                      hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa")
    ps = ParallelState.build(ParallelConfig())
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="benchmark.py optimizer")
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--ffn-hidden-size", type=int, default=1408)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--muon-num-ns-steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = {name: _measure(args, name) for name in ("adam", "sgd", "muon")}
    ref = rows["adam"]["step"]
    print(f"{'optimizer':<10}{'step ms':>10}{'vs adam':>9}{'bytes/param':>13}"
          f"{'matrices':>10}{'NS GFLOP':>10}{'NS GFLOP/s':>12}")
    for name, r in rows.items():
        rate = r["ns_flops"] / r["step"] / 1e9 if r["ns_flops"] else 0.0
        print(f"{name:<10}{r['step'] * 1e3:>10.2f}{r['step'] / ref:>9.2f}"
              f"{r['bytes']:>13.2f}{r['matrices']:>10.2%}{r['ns_flops'] / 1e9:>10.3f}"
              f"{rate:>12.1f}")
    return rows
