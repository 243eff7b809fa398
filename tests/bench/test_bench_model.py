"""tools/benchmark.py model on a tiny shape: the whole code path runs, the kernel bound's
GEMM shapes are exactly the model's linear layers (their FLOPs equal ``6 N tokens`` for
the model's N linear-layer weights), and the model FLOPs it reads from the resolved layout
are PaLM's ``6 N + 12 L h s`` with N the model's parameters but the input embedding."""

import argparse

import pytest
import torch

from tools.bench import model as bench


def _args(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=96, seq_length=32, vocab_size=256, micro_batch_size=2,
                default_cross_entropy=False)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("vocab", [256, 200])   # 200: the output layer is padded to 256
def test_kernel_bound_and_flops_are_the_models(vocab):
    args = _args(vocab_size=vocab)
    run = bench.build_config(args)
    layout, cfg = run.resolve(1), run.model
    model = bench.make_ours(cfg, False)
    bound = bench.KernelBound(layout, cfg)
    bound.probe()
    seconds, flops = bound.gemm_seconds()
    tokens = args.micro_batch_size * args.seq_length
    linear = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "word_embeddings" not in n)
    assert flops == 6.0 * linear * tokens
    assert 0 < seconds < bound.seconds()
    n = bench.matmul_params(model, hf=False)
    assert layout.flops_per_token == 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size \
        * cfg.seq_length


def test_benchmark_runs_and_reports_the_bound(capsys):
    torch.manual_seed(0)
    bench.main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32",
                "--vocab-size", "256", "--steps", "1",
                "--warmup", "1", "--no-hf", "--threads", "1"])
    out = capsys.readouterr().out
    assert "kernel bound:" in out and "megalite: fastest step at" in out
