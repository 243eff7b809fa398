"""Training-step throughput of GPTModel vs transformers' LlamaForCausalLM (single process).

    python tools/benchmark.py model [--compile] [--steps 4] [--micro-batch-size 1] ...

Times forward + backward + AdamW step of a fixed Llama-style model (default: 8 layers,
hidden 512, 8 heads / 4 query groups, SwiGLU ffn 1408, RoPE, RMSNorm, untied, vocab
32000, seq 512, micro-batch 1, fp32, dropout 0) in megalite (eager, and compiled with
``--compile``; with the chunked cross entropy of ``--cross-entropy-loss-fusion`` unless
``--default-cross-entropy``) and in ``transformers`` (sdpa attention) on the same weights,
inputs and threads. Steps of the variants are interleaved so background load hits them alike; the
median step time is reported.

MFU = model FLOP/s / the fp32 ``torch.mm`` peak measured in the same run
(:class:`megalite.hardware.MatmulPeak`, 2048 x 2048). The *kernel bound*
(:class:`KernelBound`) is the time of the model's GEMMs and attention kernel alone at the
step's shapes, measured in the same run: the MFU no implementation built on these kernels
exceeds here, and each variant's share of it. Model FLOPs per token are the training loop's
``6 N + 6 h V + 12 L h s`` (:func:`megalite.config.shapes.flops_per_token`, read from the
resolved layout; N the transformer layers' parameters, ``h V`` the output layer): PaLM's /
Megatron's ``6 N + 12 L h s`` with N all the matmul parameters, the layers and the output
layer (the input embedding table is a lookup and not counted).
On a shared machine other processes' load makes step times noisy: the fastest step is the
best estimate of this machine's speed, and process CPU time per step is reported too.

``faults`` is the process's minor page faults per step (median): on CPU every fresh
allocation above glibc's mmap threshold (32 MiB at most) is mapped anew and faulted in page
by page, which costs about as much as writing it twice. On CPU megalite's embedding
gradient and the output layer's logits and weight gradient reuse their storage from step to
step (``layers.reused_buffer``): 40,000 faults per step before the output layer reused its
buffers, about 3,300 after, at the default shape.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from megalite.hardware import MatmulPeak


class KernelBound:
    """The least time this machine needs for the model's own kernels, run alone at the
    step's shapes: each linear layer's three products (``x @ w``, ``g @ w.T``,
    ``x.T @ g``) and the causal attention kernel's forward and backward, per layer, plus
    the output layer. Each is the best of bursts taken between timed steps (the same
    background load as the steps). ``flops / seconds / peak`` is the highest MFU any
    implementation of this model reaches on this machine without faster kernels.

    The linear layers' shapes and counts are the resolved ``layout``'s ``gemms`` (one
    micro-batch on one rank, the output layer included) of the model ``m``."""

    def __init__(self, layout, m):
        self.linears = [((t, i, o), count) for t, i, o, count in layout.gemms]
        self.mats = {s: (torch.randn(s[0], s[1]), torch.randn(s[1], s[2]), torch.randn(s[0], s[2]))
                     for s, _ in self.linears}
        self.best = dict.fromkeys(self.mats, float("inf"))
        self.layers, self.attention = m.num_layers, float("inf")
        shape = (layout.micro_batch_size, m.num_attention_heads, m.seq_length, m.kv_channels)
        self.qkv = [torch.randn(shape, requires_grad=True) for _ in range(3)]
        self.grad = torch.randn(shape)

    def probe(self) -> None:
        for s, (x, w, g) in self.mats.items():
            start = time.perf_counter()
            x @ w
            g @ w.t()
            x.t() @ g
            self.best[s] = min(self.best[s], time.perf_counter() - start)
        start = time.perf_counter()
        out = torch.nn.functional.scaled_dot_product_attention(*self.qkv, is_causal=True)
        out.backward(self.grad)
        self.attention = min(self.attention, time.perf_counter() - start)
        for t in self.qkv:
            t.grad = None

    def gemm_seconds(self) -> tuple[float, float]:
        """(seconds, FLOPs) of the linear layers' products per step."""
        return (sum(self.best[s] * count for s, count in self.linears),
                sum(6.0 * s[0] * s[1] * s[2] * count for s, count in self.linears))

    def seconds(self) -> float:
        return self.gemm_seconds()[0] + self.layers * self.attention


def build_config(args):
    """The benchmarked run's config: the model, one micro-batch per step on one rank."""
    from megalite.config import MegaliteConfig, ModelConfig, TrainConfig

    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads,
                        group_query_attention=True, num_query_groups=args.num_query_groups,
                        ffn_hidden_size=args.ffn_hidden_size,
                        seq_length=args.seq_length, vocab_size=args.vocab_size,
                        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                        add_bias_linear=False, untie_embeddings_and_output_weights=True,
                        hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa",
                        cross_entropy_loss_fusion=not args.default_cross_entropy)
    batch = args.micro_batch_size
    return MegaliteConfig(model=model,
                          train=TrainConfig(micro_batch_size=batch, global_batch_size=batch))


def make_ours(cfg, compiled: bool):
    from megalite.config import ParallelConfig
    from megalite.config.run import DEFAULT_SEED
    from megalite.models.compile import maybe_compile
    from megalite.models.gpt import GPTModel
    from megalite.parallel.state import ParallelState

    model = GPTModel(cfg, ParallelState.build(ParallelConfig()), seed=DEFAULT_SEED)
    return maybe_compile(model, compiled)


def make_hf(cfg, state):
    from transformers import LlamaForCausalLM

    from megalite.models.families import get_family

    llama = get_family("llama")
    hcfg = llama.hf_config(cfg)
    hcfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hcfg)
    model.load_state_dict(llama.to_hf(state, cfg))
    return model


def step_fn(model, optimizer, ids, labels, hf: bool):
    def step():
        if hf:
            loss = model(input_ids=ids, labels=labels, shift_labels=labels, use_cache=False).loss
        else:
            loss = model(ids, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def matmul_params(model, hf: bool) -> int:
    skip = "embed_tokens" if hf else "word_embeddings"
    return sum(p.numel() for n, p in model.named_parameters() if skip not in n)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="benchmark.py model", description=__doc__.split("\n")[0])
    for name, default in (("num-layers", 8), ("hidden-size", 512), ("num-attention-heads", 8),
                          ("num-query-groups", 4), ("ffn-hidden-size", 1408),
                          ("seq-length", 512), ("vocab-size", 32000), ("micro-batch-size", 1),
                          ("steps", 4), ("warmup", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd ours")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--default-cross-entropy", action="store_true",
                   help="megalite without --cross-entropy-loss-fusion")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    run = build_config(args)
    layout, cfg = run.resolve(1), run.model
    peak = MatmulPeak(n=2048, dtype=layout.dtype)
    peak.probe(2.0)
    variants = {"megalite": make_ours(cfg, False)}
    state = variants["megalite"].full_state_dict()
    if args.compile:
        variants["megalite+compile"] = make_ours(cfg, True)
    if not args.no_hf:
        variants["transformers"] = make_hf(cfg, state)
    ids = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_length + 1))
    ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    bound = KernelBound(layout, cfg)
    for _ in range(3):
        bound.probe()
    steps = {}
    for name, model in variants.items():
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        steps[name] = step_fn(model, opt, ids, labels, hf=name == "transformers")
    for name, step in steps.items():
        start = time.perf_counter()
        first_loss = step()  # the same weights and inputs: the same first loss everywhere
        for _ in range(args.warmup - 1):
            step()
        print(f"{name}: first loss {first_loss:.6f}, warm-up {time.perf_counter() - start:.1f} s",
              flush=True)
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    faults = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c, start = time.process_time(), time.perf_counter()
            step()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - c)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        peak.probe()
        bound.probe()
    peak = peak.best

    tokens = args.micro_batch_size * args.seq_length
    n = matmul_params(variants["megalite"], hf=False)
    flops = layout.flops_per_token * tokens
    print(f"config: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
          f"{cfg.num_attention_heads}/{cfg.num_query_groups} groups, ffn {cfg.ffn_hidden_size}, "
          f"vocab {cfg.vocab_size}, seq {args.seq_length} x batch {args.micro_batch_size}, fp32, "
          f"{torch.get_num_threads()} threads; {n / 1e6:.1f} M matmul params")
    print(f"fp32 torch.mm peak: {peak / 1e9:.1f} GFLOP/s; model {flops / 1e9:.1f} GFLOP/step")
    print("tokens/s from the fastest step (best estimate on a shared machine) and the median;"
          " MFU from the fastest step; cpu = process CPU seconds per step, faults = minor page"
          " faults per step (medians)")
    best = {}
    for name in steps:
        fast, med = min(wall[name]), statistics.median(wall[name])
        best[name] = tokens / fast
        print(f"{name:>18}: {best[name]:7.1f} tokens/s (median {tokens / med:7.1f})  "
              f"MFU {flops / fast / peak:6.1%}  step {fast * 1e3:6.0f} ms  "
              f"cpu {statistics.median(cpu[name]):5.2f} s  "
              f"faults {statistics.median(faults[name]):7.0f}")
    gemm_s, gemm_flops = bound.gemm_seconds()
    print(f"kernel bound: the model's GEMMs and attention alone take {bound.seconds() * 1e3:.0f} ms"
          f" per step (its GEMM shapes run at {gemm_flops / gemm_s / peak:.1%} of the mm peak):"
          f" MFU at most {flops / bound.seconds() / peak:.1%} on this machine")
    for name in steps:
        print(f"{name:>18}: fastest step at {bound.seconds() / min(wall[name]):.1%} of the "
              "kernel bound")
    if "transformers" in best:
        for name, rate in best.items():
            if name != "transformers":
                cpu_ratio = statistics.median(cpu["transformers"]) / statistics.median(cpu[name])
                print(f"{name} / transformers: {rate / best['transformers']:.2f}x tokens/s "
                      f"({cpu_ratio:.2f}x by CPU time)")
