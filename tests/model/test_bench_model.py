"""tools/benchmark.py model on a tiny shape: the whole code path runs, and the kernel
bound's GEMM shapes are exactly the model's linear layers (their FLOPs equal
``6 N tokens`` for the model's N linear-layer weights)."""

import argparse

import torch

from tools.bench import model as bench


def _args(**kw):
    base = dict(layers=2, hidden=64, heads=4, groups=2, ffn=96, seq=32, vocab=256, batch=2,
                default_cross_entropy=False)
    return argparse.Namespace(**{**base, **kw})


def test_kernel_bound_shapes_are_the_models_linears():
    args = _args()
    cfg = bench.build_config(args)
    model = bench.make_ours(cfg, False)
    bound = bench.KernelBound(cfg, args.batch)
    bound.probe()
    seconds, flops = bound.gemm_seconds()
    tokens = args.batch * args.seq
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "word_embeddings" not in n)
    assert flops == 6.0 * linear * tokens
    assert 0 < seconds < bound.seconds()


def test_benchmark_runs_and_reports_the_bound(capsys):
    torch.manual_seed(0)
    bench.main(["--layers", "1", "--hidden", "64", "--heads", "4", "--groups", "2",
                "--ffn", "96", "--seq", "32", "--vocab", "256", "--steps", "1",
                "--warmup", "1", "--no-hf", "--threads", "1"])
    out = capsys.readouterr().out
    assert "kernel bound:" in out and "megalite: fastest step at" in out
