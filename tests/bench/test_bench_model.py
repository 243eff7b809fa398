"""tools/benchmark.py model on a tiny shape: the whole code path runs, and the kernel
bound's GEMM shapes are exactly the model's linear layers (their FLOPs equal
``6 N tokens`` for the model's N linear-layer weights)."""

import argparse

import torch

from tools.bench import model as bench


def _args(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, seq_length=32, vocab_size=256, micro_batch_size=2,
                default_cross_entropy=False)
    return argparse.Namespace(**{**base, **kw})


def test_kernel_bound_shapes_are_the_models_linears():
    args = _args()
    cfg = bench.build_config(args)
    model = bench.make_ours(cfg, False)
    bound = bench.KernelBound(cfg, args.micro_batch_size)
    bound.probe()
    seconds, flops = bound.gemm_seconds()
    tokens = args.micro_batch_size * args.seq_length
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "word_embeddings" not in n)
    assert flops == 6.0 * linear * tokens
    assert 0 < seconds < bound.seconds()


def test_benchmark_runs_and_reports_the_bound(capsys):
    torch.manual_seed(0)
    bench.main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32",
                "--vocab-size", "256", "--steps", "1",
                "--warmup", "1", "--no-hf", "--threads", "1"])
    out = capsys.readouterr().out
    assert "kernel bound:" in out and "megalite: fastest step at" in out
