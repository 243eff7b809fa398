"""Training-step throughput on one GPU: megalite (bf16, --compile, fusions) vs transformers.

    python tools/benchmark.py gpu [--small] [--no-compile] [--steps 10] [--grad-accum 1]
                                  [--num-layers 16] ...
    python tools/benchmark.py gpu --device cpu --small --no-compile   # smoke run on a CPU

Default shape (Llama ~1.1B): 16 layers, hidden 2048, 32 heads / 8 query groups, SwiGLU ffn
8192, RoPE, RMSNorm, untied, vocab 32000, seq 2048, micro-batch 4, one micro-batch per step
(``--grad-accum N``: N micro-batches per optimizer step, so that the step's fixed costs,
Muon's Newton-Schulz above all, are shared as at a real global batch); ``--wide``: eight of
Llama-3 8B's layers (hidden 4096, 32 heads / 8 groups, SwiGLU ffn 14336), vocab 32000,
seq 4096 x micro-batch 2, the same 8,192 tokens a micro-batch with the GEMMs a larger
share of the step; ``--small`` is a tiny shape for smoke runs. In one run, on the same
weights and inputs:

* megalite: GPTModel in bf16 with fp32 master weights (``MixedPrecisionOptimizer``, its
  fused AdamW), per-layer ``torch.compile`` (unless ``--no-compile``), the chunked
  cross entropy (``--cross-entropy-loss-fusion``) and attention ``auto`` (flash-attn when
  installed, else PyTorch's SDPA);
* extra megalite rows, each from the same seed: ``--fp8-recipe tensorwise,delayed`` (the
  tensor-parallel linears in fp8, hybrid format; the real ``torch._scaled_mm`` kernel on
  compute capability 8.9+, block recipes emulated) and ``--muon`` (``--optimizer muon``),
  each printed as a ratio to the bf16 AdamW row; with ``--muon`` also Muon's theory: the
  Newton-Schulz FLOPs of the step (every matrix, :meth:`megalite.optim.muon_layout.Matrix.
  cost`) against the step's model FLOPs, and its step's overhead over AdamW's as a share
  of its step (:func:`overhead_line`);
* transformers: LlamaForCausalLM with fp32 weights under bf16 autocast, SDPA attention,
  ``torch.optim.AdamW(fused=True)``.

Printed: tokens/s (median step), MFU against the device's table peak
(:data:`megalite.hardware.GPU_PEAK_FLOPS`) and against the ``torch.mm`` peak of the
model's dtype (bf16) measured here (:class:`megalite.hardware.MatmulPeak`), the peak memory
of each, the graph breaks of each compiled row (with the commonest reason: a break cuts a
layer's compiled code, and the cut-off part runs eagerly), each row's split of a profiled
step (the GPU's busy time against the span of its kernels, so its idle time waiting on
the host; the GEMMs' share and the rest's; :func:`time_split`), under each fp8 row its
ceiling at this shape (bf16's step with only the fp8 linears' GEMMs at the fp8 row's GEMM
time, against the fp8 row's step: what quantisation and host work cost;
:func:`fp8_ceiling`), and the top kernels (torch.profiler) of the first row, or of the
first ``--top-rows`` rows. Model FLOPs per token are the
training loop's ``6 N + 6 h V + 12 L h s`` (:func:`megalite.config.shapes.flops_per_token`,
read from the resolved layout), as in ``tools/bench/model.py``. Without CUDA (and no
``--device cpu``) it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time

import torch
from torch._dynamo.utils import counters

from megalite import hardware

SHAPES = {  # name: the values of FIELDS
    "default": (16, 2048, 32, 8, 8192, 32000, 2048, 4),
    "wide": (8, 4096, 32, 8, 14336, 32000, 4096, 2),
    "small": (2, 128, 4, 2, 352, 1024, 128, 2),
}
FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
          "ffn_hidden_size", "vocab_size", "seq_length", "micro_batch_size")


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmark.py gpu", description=__doc__.split("\n")[0])
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--small", action="store_true", help="a tiny shape (smoke runs)")
    shape.add_argument("--wide", action="store_true",
                       help="Llama-3 8B's layer (hidden 4096, 32 heads / 8 groups, SwiGLU "
                            "ffn 14336), 8 layers, vocab 32000, seq 4096 x batch 2: the "
                            "GEMMs' share of the step, and so fp8's ceiling, of a larger "
                            "model")
    for name in FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {SHAPES['default'][FIELDS.index(name)]}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (and compilation)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="megalite eager")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode for megalite")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--fp8-recipe", default="",
                   help="comma-separated fp8 recipes (tensorwise, delayed, mxfp8, blockwise) "
                        "timed as extra megalite rows against the bf16 row (--fp8-format "
                        "hybrid); empty: none")
    p.add_argument("--fp8-format", default="hybrid", choices=("hybrid", "e4m3"),
                   help="the fp8 rows' format (e4m3: every GEMM's operands in e4m3, which "
                        "blockwise's block-scaled kernel takes on Hopper)")
    p.add_argument("--muon", action="store_true",
                   help="an extra megalite row with --optimizer muon (its step's cost "
                        "against AdamW's)")
    p.add_argument("--no-bf16", action="store_true",
                   help="skip megalite's bf16 AdamW row (the reference of the extra rows)")
    p.add_argument("--top", type=int, default=10, help="kernels in the profile (0: none)")
    p.add_argument("--top-rows", type=int, default=1, help="how many rows, from the first, "
                   "print that profile")
    p.add_argument("--no-split", dest="split", action="store_false",
                   help="skip each row's profiled split of the step (GPU busy / idle, "
                        "GEMMs, the rest)")
    args = p.parse_args(argv)
    base = SHAPES["small" if args.small else "wide" if args.wide else "default"]
    for name, value in zip(FIELDS, base):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def build_config(args, fp8_recipe: str | None = None, optimizer: str = "adam"):
    """The benchmarked run's config: the bf16 model (its linears in fp8 with ``fp8_recipe``,
    ``--fp8-format``), AdamW (or ``optimizer``), ``--grad-accum`` micro-batches per step on
    one rank."""
    from megalite.config import MegaliteConfig, ModelConfig, OptimConfig, TrainConfig

    model = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                        num_attention_heads=args.num_attention_heads,
                        group_query_attention=True, num_query_groups=args.num_query_groups,
                        ffn_hidden_size=args.ffn_hidden_size,
                        seq_length=args.seq_length, max_position_embeddings=args.seq_length,
                        vocab_size=args.vocab_size, normalization="RMSNorm", swiglu=True,
                        position_embedding_type="rope", add_bias_linear=False,
                        untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                        attention_dropout=0.0, attention_backend="auto", bf16=True,
                        cross_entropy_loss_fusion=True)
    if fp8_recipe:
        model = dataclasses.replace(model, fp8_format=args.fp8_format, fp8_recipe=fp8_recipe)
    batch = args.micro_batch_size
    optim = OptimConfig(optimizer=optimizer, lr=1e-4, weight_decay=0.01)
    return MegaliteConfig(model=model, optim=optim,
                          train=TrainConfig(micro_batch_size=batch,
                                            global_batch_size=batch * args.grad_accum))


class Device:
    """Synchronisation and peak memory of the benchmark's device."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> str:
        if not self.cuda:
            return "n/a on cpu"
        return f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"


def make_megalite(run, dev: Device, compiled: bool, mode: str | None, accum: int = 1):
    """(model, step function, Muon's Newton-Schulz FLOPs per step) of megalite's own
    training step: bf16 model, fp32 master weights and main grads, ``accum`` micro-batches
    (each loss divided by ``accum``), fp8's end of step (the training loop's
    :func:`megalite.training.fp8.finish_fp8_step`: the step's fp8 weights forgotten,
    delayed scaling's history pushed), the optimizer of ``megalite.optim.build``."""
    from megalite.config import ParallelConfig
    from megalite.config.run import DEFAULT_SEED
    from megalite.models.compile import maybe_compile
    from megalite.models.gpt import GPTModel
    from megalite.optim.build import build_grads_and_optimizer
    from megalite.optim.algorithms.muon import is_matrix
    from megalite.optim.muon_layout import matrices
    from megalite.parallel.state import ParallelState
    from megalite.training.fp8 import finish_fp8_step

    ps = ParallelState.build(ParallelConfig(), device=dev.device)
    model = GPTModel(run.model, ps, seed=DEFAULT_SEED)
    grads, optimizer = build_grads_and_optimizer(model, run, ps)
    maybe_compile(model, compiled, mode=mode)
    ns_flops = 0.0
    if run.optim.optimizer == "muon":
        named = [(n, p) for n, p in model.named_parameters() if is_matrix(n, p)]
        ns_flops = sum(m.cost(run.optim.muon_num_ns_steps)
                       for m in matrices(named, ps, run.optim))

    def step(ids, labels):
        grads.zero_grad(num_microbatches=accum)
        total = 0.0
        for _ in range(accum):
            loss = model(ids, labels=labels).mean()
            optimizer.scale_loss(loss / accum).backward()
            total += loss.detach() / accum
        grads.finish_grad_sync()
        finish_fp8_step([model], ps)
        optimizer.step()
        return total

    return model, step, ns_flops


def make_transformers(cfg, state, dev: Device, accum: int = 1):
    """(model, step function): LlamaForCausalLM, fp32 weights, bf16 autocast, fused AdamW,
    ``accum`` micro-batches per step."""
    from transformers import LlamaForCausalLM

    from megalite.models.families import get_family

    llama = get_family("llama")
    hcfg = llama.hf_config(cfg)
    hcfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hcfg)
    model.load_state_dict({k: v.float() for k, v in llama.to_hf(state, cfg).items()})
    model.to(dev.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(ids, labels):
        total = 0.0
        for _ in range(accum):
            with torch.autocast(dev.device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels, shift_labels=labels,
                             use_cache=False).loss
            (loss / accum).backward()
            total += loss.detach() / accum
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return model, step


def time_steps(step, ids, labels, dev: Device, warmup: int, steps: int):
    """(first loss, warm-up seconds, per-step seconds, peak memory) of ``step``."""
    dev.reset_memory()
    start = time.perf_counter()
    first = float(step(ids, labels))
    for _ in range(warmup - 1):
        step(ids, labels)
    dev.sync()
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(ids, labels)
        dev.sync()
        times.append(time.perf_counter() - start)
    return first, warm, times, dev.peak_memory()


def top_kernels(step, ids, labels, dev: Device, top: int) -> str:
    """The ``top`` ops/kernels by self device time (CPU time on a CPU) over two steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(ids, labels)
        dev.sync()
    key = "self_cuda_time_total" if dev.cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)


SHORT_US = 10   # a kernel shorter than this is about as long as the host's launch of it
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
            "aten::_scaled_mm_v2", "aten::_grouped_mm", "aten::_scaled_grouped_mm")


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def time_split(step, ids, labels, dev: Device) -> dict:
    """Where two profiled steps' time goes. On a GPU (microseconds): ``span`` first kernel
    start to last kernel end, ``busy`` the time at least one kernel runs (the union of
    their intervals: kernels on different streams can overlap; ``span - busy``: the GPU
    idle, waiting on the host's launches and syncs), ``gemm`` the GEMM operators' kernels
    (:data:`GEMM_OPS`, fp8's ``_scaled_mm`` included; GEMMs inductor writes itself, as
    under max-autotune, count in the rest) and ``ops`` the same by operator, ``kernels``
    the kernels launched and ``short`` those that ran under :data:`SHORT_US` (where the
    host's launch of each, some microseconds, takes longer than the kernel, a stretch of
    them leaves the GPU idle). On a CPU the same from the operators' self CPU time (no
    idle measured; ``kernels`` the operators called)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(ids, labels)
        dev.sync()
    averages = prof.key_averages()
    if dev.cuda:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        starts = [e.time_range.start for e in kernels]
        span = max(e.time_range.end for e in kernels) - min(starts) if kernels else 0.0
        busy = _covered([(e.time_range.start, e.time_range.end) for e in kernels])
        ops = {e.key: e.device_time_total / 2 for e in averages if e.key in GEMM_OPS}
        count = len(kernels)
        short = sum(e.time_range.elapsed_us() < SHORT_US for e in kernels)
    else:
        busy = sum(e.self_cpu_time_total for e in averages)
        span = busy
        ops = {e.key: e.self_cpu_time_total / 2 for e in averages if e.key in GEMM_OPS}
        count, short = sum(e.count for e in averages), 0
    return {"span": span / 2, "busy": busy / 2, "gemm": sum(ops.values()), "ops": ops,
            "kernels": count // 2, "short": short // 2}


def split_line(name: str, split: dict, cuda: bool) -> str:
    """``name``'s :func:`time_split` per step, in ms."""
    span, busy, gemm = (split[k] / 1e3 for k in ("span", "busy", "gemm"))
    if not cuda:
        return (f"{name:>30}: per step {busy:.1f} ms of CPU op time, GEMMs {gemm:.1f} ms, "
                f"{split['kernels']} ops")
    return (f"{name:>30}: per step (profiled) GPU busy {busy:.1f} of {span:.1f} ms "
            f"(idle {span - busy:.1f} ms), GEMMs {gemm:.1f} ms, the rest {busy - gemm:.1f} ms; "
            f"{split['kernels']} kernels, {split['short']} of them under {SHORT_US} us")


FP8_GEMM_OPS = ("aten::_scaled_mm", "aten::_scaled_mm_v2", "aten::_scaled_grouped_mm")


def fp8_ceiling(name: str, bf16: dict, fp8: dict) -> str | None:
    """What fp8 can give at this shape, from two rows' :func:`time_split`: the bf16 row's
    step with only its fp8 linears' GEMMs changed to the fp8 row's fp8 GEMM time (the
    fp8 row's remaining bf16 GEMMs, the output layer's, are the bf16 row's too), every
    other kernel and the idle time as in bf16; against it the fp8 row's own step, and
    what its quantisation (more kernel time) and host work (more idle) cost over bf16.
    None when the fp8 row ran no fp8 kernel (an emulated block recipe)."""
    scaled = sum(fp8["ops"].get(op, 0.0) for op in FP8_GEMM_OPS)
    if not scaled or not bf16["span"] or not fp8["span"]:
        return None
    linears = bf16["gemm"] - (fp8["gemm"] - scaled)   # bf16's time in the fp8 linears' GEMMs
    ceiling = bf16["span"] - linears + scaled
    kernels = (fp8["busy"] - fp8["gemm"]) - (bf16["busy"] - bf16["gemm"])
    idle = (fp8["span"] - fp8["busy"]) - (bf16["span"] - bf16["busy"])
    ms = 1e-3
    return (f"{name:>30}: ceiling: bf16's profiled step {bf16['span'] * ms:.1f} ms with its "
            f"linears' GEMMs ({linears * ms:.1f} ms) at this row's fp8 GEMM time "
            f"({scaled * ms:.1f} ms) = {ceiling * ms:.1f} ms, "
            f"{bf16['span'] / ceiling:.2f}x; this row (profiled) {fp8['span'] * ms:.1f} ms, "
            f"{bf16['span'] / fp8['span']:.2f}x: {(fp8['span'] - ceiling) * ms:+.1f} ms over "
            f"the ceiling (other kernels {kernels * ms:+.1f} ms, idle {idle * ms:+.1f} ms)")


def graph_breaks(name: str) -> str:
    """The graph breaks dynamo counted since they were cleared (a compiled row's warm-up
    and steps): their number, and the commonest reason's first two lines where there are
    any (a break splits a layer's compiled code, and what it cuts off runs eagerly)."""
    breaks = counters["graph_break"]
    total = sum(breaks.values())
    if not total:
        return f"{name:>30}: graph breaks 0"
    reason, count = max(breaks.items(), key=lambda kv: kv[1])
    lines = [line.strip() for line in reason.splitlines() if line.strip()][:2]
    return f"{name:>30}: graph breaks {total}, {count} of them: {' / '.join(lines)[:240]}"


def overhead_line(muon_s: float, adam_s: float, accum: int) -> str:
    """Muon's step overhead (median steps, seconds) over the AdamW row's, as a share of
    Muon's step: the measure of its < 5% target."""
    extra = muon_s - adam_s
    return (f"Muon's step overhead at {accum} micro-batches per step: {extra * 1e3:+.1f} ms, "
            f"{extra / muon_s:+.1%} of its step ({muon_s * 1e3:.1f} against AdamW's "
            f"{adam_s * 1e3:.1f} ms)")


def tflops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e11 else f"{rate / 1e9:.1f} GFLOP/s"


def main(argv=None) -> None:
    args = parse(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmark gpu: needs CUDA (no GPU visible here); "
              "`--device cpu --small --no-compile` runs its smoke mode")
        return
    dev = Device(args.device)
    torch.manual_seed(0)
    run = build_config(args)
    layout, cfg = run.resolve(1), run.model
    table_peak, device_name = hardware.table_peak(dev.device)
    measured_peak = hardware.MatmulPeak(8192 if dev.cuda else 256, layout.dtype, dev.device,
                                        burst=10).probe(2.0 if dev.cuda else 0.2)
    mbs, seq = args.micro_batch_size, args.seq_length
    ids = torch.randint(0, cfg.vocab_size, (mbs, seq + 1), device=dev.device)
    ids, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    accum = args.grad_accum
    tokens = mbs * seq * accum   # per optimizer step

    compiled = not args.no_compile
    suffix = "+compile" if compiled else ""
    variants = [] if args.no_bf16 else [("megalite" + suffix, run)]
    for recipe in filter(None, args.fp8_recipe.split(",")):
        variants.append((f"megalite{suffix}+fp8-{recipe}", build_config(args, recipe)))
    if args.muon:
        variants.append((f"megalite{suffix}+muon", build_config(args, optimizer="muon")))
    for _, variant in variants:   # bad shapes (fp8 tiling) fail here, before any timing
        variant.resolve(1)
    flops = layout.flops_per_token * tokens
    print(f"device: {device_name}; config: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"heads {cfg.num_attention_heads}/{cfg.num_query_groups} groups, ffn "
          f"{cfg.ffn_hidden_size}, vocab {cfg.vocab_size}, seq {seq} x batch {mbs} x "
          f"{accum} micro-batches per step, bf16; {flops / 1e9:.4g} GFLOP/step")
    table = tflops(table_peak) if table_peak else "n/a"
    print(f"peaks: table {table}; measured bf16 torch.mm {tflops(measured_peak)}; first "
          "losses should agree to bf16 rounding (same weights and inputs)", flush=True)
    rates, splits, state, profiles = {}, {}, None, []

    def report(name, first, warm, times, memory):   # a row as soon as it is timed
        med = statistics.median(times)
        rates[name] = tokens / med
        mfu_table = f"{flops / med / table_peak:6.1%}" if table_peak else "   n/a"
        print(f"{name:>30}: {rates[name]:9.1f} tokens/s  MFU {mfu_table} of table, "
              f"{flops / med / measured_peak:6.1%} of measured  step {med * 1e3:7.1f} ms  "
              f"peak memory {memory}  first loss {first:.4f}  warm-up {warm:.1f} s",
              flush=True)

    for i, (name, variant) in enumerate(variants):   # the same initial weights (one seed)
        counters["graph_break"].clear()
        model, step, ns_flops = make_megalite(variant, dev, compiled, args.compile_mode,
                                              accum)
        if ns_flops:
            print(f"Muon's theory: Newton-Schulz {ns_flops / 1e9:.4g} GFLOP per step "
                  f"({variant.optim.muon_num_ns_steps} steps, every matrix once) = "
                  f"{ns_flops / flops:.1%} of the step's model FLOPs; it is fixed per "
                  "optimizer step, so --grad-accum (or the distributed optimizer over dp "
                  "ranks) divides its share", flush=True)
        if state is None and not args.no_hf:
            state = {k: v.cpu() for k, v in model.full_state_dict().items()}
        report(name, *time_steps(step, ids, labels, dev, args.warmup, args.steps))
        if compiled:
            print(graph_breaks(name), flush=True)
        if args.split:
            splits[name] = time_split(step, ids, labels, dev)
            print(split_line(name, splits[name], dev.cuda), flush=True)
            # against the bf16 row (on a CPU the fp8 kernel's own fp32 matmuls count as
            # bf16 GEMMs: no ceiling there)
            if variant.model.fp8_format and not args.no_bf16 and dev.cuda:
                line = fp8_ceiling(name, splits[variants[0][0]], splits[name])
                print(line or f"{name:>30}: no fp8 kernel ran (emulated): no ceiling",
                      flush=True)
        if i < args.top_rows and args.top:
            profiles.append((name, top_kernels(step, ids, labels, dev, args.top)))
        del model, step
    if not args.no_hf and state is not None:
        hf_model, hf_step = make_transformers(cfg, state, dev, accum)
        del state
        report("transformers", *time_steps(hf_step, ids, labels, dev, args.warmup, args.steps))
        del hf_model, hf_step
    if "transformers" in rates:
        for name, rate in rates.items():
            if name != "transformers":
                print(f"{name} / transformers: {rate / rates['transformers']:.2f}x tokens/s")
    reference = variants[0][0] if variants and not args.no_bf16 else None
    for name, rate in rates.items():
        if reference and name not in (reference, "transformers"):
            print(f"{name} / {reference}: {rate / rates[reference]:.2f}x tokens/s")
            if dict(variants)[name].optim.optimizer == "muon":   # its cost over AdamW's
                print(overhead_line(tokens / rate, tokens / rates[reference], accum))
    for name, profile in profiles:
        print(f"top {args.top} kernels of {name}'s step (2 steps, by self "
              f"{'CUDA' if dev.cuda else 'CPU'} time):")
        print(profile)
