"""fp8 linear layers against bf16 at a model's GEMM shapes: time and error.

    python tools/benchmark.py fp8 [--recipe tensorwise,delayed,mxfp8,blockwise] [--small]
                                  [--device cuda|cpu] [--repeat 10]

For each linear of one transformer layer (``megalite.config.shapes.layer_gemms``: qkv,
output projection, fc1, fc2; ``tokens = micro-batch x seq``) in the same run:

* **layer**: forward + backward (its three GEMMs: forward, input gradient, weight
  gradient) of ``F.linear`` in bf16 against megalite's fp8 linear
  (:func:`megalite.layers.fp8.gemm.fp8_linear`, hybrid format) under each recipe,
  quantisation included (the weight's too, as at a step's first micro-batch);
* **kernel**: the forward GEMM alone, bf16 ``torch.mm`` against ``torch._scaled_mm`` on
  operands already in fp8 (per-tensor scales): the kernel's own ratio, the ceiling of
  what the layer can gain;
* **error**: the fp8 forward's relative error (Frobenius) against the fp32 product;
* **quantisation work** per recipe, summed over the linears it tiles: the fp8 tensors a
  forward + backward writes (quantisations, fp8 transposed copies, e8m0 scales; counted
  by :class:`Fp8Writes`), their MiB and the amax reductions, at a step's first
  micro-batch (the weight quantised) and at a later one (the step's fp8 weights reused),
  with each one's time.

The default shape is ``benchmark.py gpu``'s ~1.1B Llama (hidden 2048, ffn 8192, 32/8
heads, seq 2048, micro-batch 4); ``--small`` a tiny one. On a CPU the fp8 GEMMs are the
CPU's ``_scaled_mm`` or an fp32 emulation (block recipes), so the times there are the
emulation's cost, printed for completeness: CPU speed is not what fp8 is for. On a GPU
it says which block recipes run a kernel (``blockwise`` on Hopper) and which the
emulation.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megalite.config.fp8 import FP8_TILE

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


class Fp8Writes(TorchDispatchMode):
    """Counts, while active, the fp8 tensors the ops write (``shapes``: shape -> count; a
    quantisation, an fp8 transposed copy or an e8m0 scale tensor each writes one; views
    write none) and the ``amax`` reductions (amax / max ops): the quantisation passes of
    the code it wraps, on any device (the autograd engine's backward included)."""

    def __init__(self):
        super().__init__()
        self.shapes: collections.Counter = collections.Counter()
        self.bytes = 0
        self.amax = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.amax, torch.ops.aten.max):
            self.amax += 1
        if not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:
                    self.shapes[tuple(t.shape)] += 1
                    self.bytes += t.numel()
        return out

    @property
    def writes(self) -> int:
        return sum(self.shapes.values())


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmark.py fp8", description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="tensorwise,delayed,mxfp8,blockwise",
                   help="comma-separated fp8 recipes")
    p.add_argument("--small", action="store_true", help="a tiny shape (smoke runs)")
    p.add_argument("--device", default=None, help="cuda when there is one, else cpu")
    p.add_argument("--repeat", type=int, default=10, help="timed repetitions (median)")
    args = p.parse_args(argv)
    args.recipes = [r for r in args.recipe.split(",") if r]
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        p.error(f"--recipe {','.join(unknown)}: choose from {', '.join(RECIPES)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def shapes(small: bool) -> tuple[list[tuple[str, tuple[int, int, int]]], str]:
    """``[(name, (tokens, in, out))]`` of one layer's linears, and the shape's words."""
    from megalite.config.shapes import layer_gemms
    from tools.bench.gpu import build_config
    from tools.bench.gpu import parse as gpu_parse

    run = build_config(gpu_parse(["--small"] if small else []))
    m, t = run.model, run.train
    tokens = t.micro_batch_size * m.seq_length
    names = ("qkv", "proj", "fc1", "fc2")
    words = (f"hidden {m.hidden_size}, ffn {m.ffn_hidden_size}, heads "
             f"{m.num_attention_heads}/{m.num_query_groups}, {tokens} tokens")
    return list(zip(names, layer_gemms(m, tokens))), words


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn()`` (after one untimed call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scaling_for(recipe: str, device: torch.device):
    from megalite.layers.fp8.recipes import Fp8Recipe
    from megalite.layers.fp8.scaling import Fp8Scaling

    scaling = Fp8Scaling(Fp8Recipe("hybrid", recipe), ((), (), ()), device=device)
    if recipe == "delayed":   # a history as after a step: this tensor's amaxes
        scaling.amax_history.fill_(4.0)
    return scaling


def measure(shape, recipes, device, repeat) -> dict:
    """Times (s) and errors of one linear ``shape`` = (tokens, in, out)."""
    from megalite.layers.fp8.gemm import fp8_linear, scaled_mm
    from megalite.layers.fp8.recipes import E4M3, dequant_scale, quantize

    tokens, k, n = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    x32 = torch.randn(tokens, k, generator=g).to(device)
    w32 = (torch.randn(n, k, generator=g) / k ** 0.5).to(device)
    dy = torch.randn(tokens, n, generator=g).to(device, torch.bfloat16)
    ref = x32 @ w32.t()
    x = x32.bfloat16().requires_grad_()
    w = w32.bfloat16().requires_grad_()

    def bf16_step():
        F.linear(x, w).backward(dy)

    out = {"bf16": timed(bf16_step, device, repeat), "error": {}, "fp8": {}, "work": {},
           "later": {}}
    for recipe in recipes:
        if any(d % FP8_TILE[recipe] for d in shape):   # the recipe cannot tile it
            continue
        scaling = scaling_for(recipe, device)

        def fp8_step():
            scaling.forget_weight()          # the weight quantised too (a step's first call)
            fp8_linear(x, w, None, scaling).backward(dy)

        out["fp8"][recipe] = timed(fp8_step, device, repeat)
        # quantisation work at a step's first micro-batch and at a later one (the step's
        # fp8 weights kept), and the later one's time
        scaling.forget_weight()
        work = []
        for _ in range(2):
            with Fp8Writes() as count:
                fp8_linear(x, w, None, scaling).backward(dy)
            work.append((count.writes, count.bytes, count.amax))
        out["work"][recipe] = work
        out["later"][recipe] = timed(lambda: fp8_linear(x, w, None, scaling).backward(dy),
                                     device, repeat)
        with torch.no_grad():
            scaling.forget_weight()
            y = fp8_linear(x, w, None, scaling).float()
        out["error"][recipe] = float((y - ref).norm() / ref.norm())
    xb, wb = x.detach(), w.detach()
    dx, dw = dequant_scale(x32.abs().max(), E4M3), dequant_scale(w32.abs().max(), E4M3)
    qx, qw = quantize(x32, dx, E4M3), quantize(w32, dw, E4M3)
    out["mm_bf16"] = timed(lambda: xb @ wb.t(), device, repeat)
    out["mm_fp8"] = timed(lambda: scaled_mm(qx, qw, dx, dw, torch.bfloat16), device, repeat)
    return out


def main(argv=None) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    linears, words = shapes(args.small)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"fp8 linears against bf16 on {where}: one layer's linears ({words}); hybrid "
          "format; forward + backward with quantisation, and the forward kernel alone")
    if device.type == "cpu":
        print("on the CPU fp8 GEMMs are the CPU's _scaled_mm or an fp32 emulation: these "
              "times are the emulation's cost; CPU speed is not what fp8 is for")
    else:
        print(f"block recipes here: {block_gemm_paths(device)}")
    cols = "".join(f" {r:>12}" for r in args.recipes)
    print(f"{'linear':>6} {'tokens x in x out':>22} {'bf16 ms':>9}{cols}   kernel fp8/bf16"
          "   fp8 error vs fp32")
    total = {"bf16": 0.0, "mm_bf16": 0.0, "mm_fp8": 0.0, **{r: 0.0 for r in args.recipes}}
    # per recipe: [linears, first (writes, bytes, amax), later (...), first ms, later ms]
    work = {r: [0, [0, 0, 0], [0, 0, 0], 0.0, 0.0] for r in args.recipes}
    for name, shape in linears:
        r = measure(shape, args.recipes, device, args.repeat)
        for recipe, (first, later) in r["work"].items():
            acc = work[recipe]
            acc[0] += 1
            acc[1] = [a + b for a, b in zip(acc[1], first)]
            acc[2] = [a + b for a, b in zip(acc[2], later)]
            acc[3] += r["fp8"][recipe]
            acc[4] += r["later"][recipe]
        total["bf16"] += r["bf16"]
        total["mm_bf16"] += r["mm_bf16"]
        total["mm_fp8"] += r["mm_fp8"]
        speed = ""
        for recipe in args.recipes:
            if recipe not in r["fp8"]:
                total[recipe] = None
                speed += f" {'n/a':>12}"
                continue
            if total[recipe] is not None:
                total[recipe] += r["fp8"][recipe]
            speed += f" {r['bf16'] / r['fp8'][recipe]:11.2f}x"
        errors = " ".join(f"{r['error'][x]:.2e}" if x in r["error"] else "n/a"
                          for x in args.recipes)
        dims = "x".join(map(str, shape))
        print(f"{name:>6} {dims:>22} {r['bf16'] * 1e3:9.3f}{speed}   "
              f"{r['mm_bf16'] / r['mm_fp8']:13.2f}x   {errors}")
    speed = "".join(f" {total['bf16'] / total[r]:11.2f}x" if total[r] else f" {'n/a':>12}"
                    for r in args.recipes)
    print(f"{'layer':>6} {'':>22} {total['bf16'] * 1e3:9.3f}{speed}   "
          f"{total['mm_bf16'] / total['mm_fp8']:13.2f}x   (speed-ups over bf16; n/a: the "
          "recipe's block does not tile a dimension)")
    print_work(work)


def block_gemm_paths(device: torch.device) -> str:
    """What multiplies each block recipe's operands on ``device`` (a CUDA GPU)."""
    from megalite.layers.fp8.gemm import block_kernel_takes

    probe = torch.zeros(16, 128, device=device).to(torch.float8_e4m3fn)
    blockwise = ("torch's block-scaled kernel for the e4m3 forward (hybrid's e5m2 gradient "
                 "GEMMs emulated)" if block_kernel_takes(probe, probe, 128, False)
                 else "fp32 emulation (the kernel needs compute capability 9.0, CUDA 12.9+)")
    return f"blockwise {blockwise}; mxfp8 fp32 emulation (no MX kernel called)"


def print_work(work: dict) -> None:
    """The quantisation work of the recipes' linears (those each recipe tiles), at a
    step's first micro-batch (the weights quantised) and at a later one (the step's fp8
    weights reused): fp8 tensors written (quantisations, fp8 transposed copies, e8m0
    scales), their MiB, amax reductions, and forward + backward ms."""
    print("quantisation work per micro-batch (forward + backward; fp8 tensors written, "
          "their MiB, amax reductions, ms) at a step's first micro-batch / a later one")
    print(f"{'recipe':>10} {'linears':>7}   {'writes':>6} {'MiB':>8} {'amax':>4} {'ms':>9}   "
          f"{'writes':>6} {'MiB':>8} {'amax':>4} {'ms':>9}")
    for recipe, (n, first, later, first_s, later_s) in work.items():
        cells = "   ".join(f"{w:6d} {b / 2**20:8.3f} {a:4d} {t * 1e3:9.3f}"
                           for (w, b, a), t in ((first, first_s), (later, later_s)))
        print(f"{recipe:>10} {n:7d}   {cells}")
