"""The largest GPT (layers at a fixed hidden size) that trains per data-parallel sharding
strategy, with and without optimizer CPU offload and activation offload: predicted by the
planner's memory model, confirmed by training it under a per-rank memory cap.

``python tools/benchmark.py largest-model [--dp 2] [--hidden-size 512] [--seq-length 128]
[--vocab-size 8192] [--cap-gib 2] [--machine-gib 24] [--no-confirm]
[--only optim/none optim/opt ...]``

Variants: each ``--data-parallel-sharding-strategy`` megalite accepts
(:data:`megalite.config.parallel.SHARDING_STRATEGIES`) x offload: none,
``opt`` (``--optimizer-cpu-offload --optimizer-offload-fraction 1``, sharded strategies only),
``act`` (``--cpu-offloading --cpu-offloading-num-layers L-1``), ``opt+act``. bf16, Adam,
micro-batch 1, global batch ``dp``.

**Predicted** (no memory allocated): per rank, :func:`megalite.planner.memory.estimate_memory`
of the run without offload, then the offloads move bytes from the device to the host: the
optimizer term (masters and moments) and a fp32 gradient copy (4 B per offloaded parameter
of the shard) for ``opt``; ``L - 1`` layers' saved activations for ``act``. ``device``: what
stays on the accelerator; ``host``: the offloaded bytes.

**What the numbers mean on this machine.** It has no accelerator: "device" memory is host
memory, so an offloaded byte is still a byte of this machine's RAM (plus, for activation
offload, the copy). The cap therefore applies to ``device + host``, and offload cannot make
a larger model fit here; its column shows what a GPU with ``--machine-gib`` of memory per
rank (and enough host memory) would fit, from the prediction only.

**Confirmed**: for each variant the predicted largest model under ``--cap-gib`` per rank is
built on ``--dp`` gloo ranks (spawned processes) and trains 2 steps (forward, backward,
reduction, optimizer step; the second step holds the optimizer state and the activations at
once). Measured: each rank's peak resident set size (``ru_maxrss``) minus its resident set
after start-up (torch and the process group, before the model is built). The model fits if
the measured peak is within the cap; if it is not, a smaller model is tried (scaled by how
far over the cap it went; up to 5 tries). ``measured (pred)``: the confirmed model's
measured peak and the planner's ``device + host`` for it.
An address-space limit (``RLIMIT_AS``, start-up size + 3 x cap) stops a rank that would run
away, so the machine is never asked for more than about ``dp x cap``.

Extrapolated: the largest model for ``--machine-gib`` of RAM shared by the ``dp`` ranks of
this CPU machine (cap ``machine / dp`` on ``device + host``; ``calibrated``: the same with
the prediction scaled by the confirmed run's measured / predicted peak, which on this CPU
includes what the planner does not count, e.g. the foreach Adam step's full-size
temporaries and the allocator's slack), and for a GPU with ``--machine-gib`` per rank (cap
on ``device`` only).
"""

from __future__ import annotations

import argparse
import os

from megalite.config.parallel import SHARDING_STRATEGIES

GIB = 2.0 ** 30
OFFLOADS = ("none", "opt", "act", "opt+act")


def _config(args, layers: int, strategy: str, offload: str):
    """The variant's validated config (ConfigError when megalite refuses it)."""
    from megalite.arguments import parse_args

    flags = ["--num-layers", str(layers), "--hidden-size", str(args.hidden_size),
             "--num-attention-heads", str(max(1, args.hidden_size // 64)),
             "--seq-length", str(args.seq_length),
             "--max-position-embeddings", str(args.seq_length),
             "--vocab-size", str(args.vocab_size), "--make-vocab-size-divisible-by", "128",
             "--bf16", "--micro-batch-size", "1", "--global-batch-size", str(args.dp),
             "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "sdpa",
             "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--data-parallel-sharding-strategy", strategy]
    if "opt" in offload.split("+"):
        flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1"]
    if "act" in offload.split("+") and layers > 1:
        flags += ["--cpu-offloading", "--cpu-offloading-num-layers", str(layers - 1)]
    return parse_args(flags).validate(args.dp)


def predict(args, layers: int, strategy: str, offload: str) -> tuple[float, float]:
    """(device, host) bytes per rank predicted for the variant with ``layers`` layers."""
    from megalite.planner.memory import estimate_memory, layer_activation_elements

    cfg = _config(args, layers, strategy, "none")
    est = estimate_memory(cfg, args.dp, device_type="cpu")
    device, host = est.total, 0.0
    if "opt" in offload.split("+"):
        shard = est.params_elements / (args.dp if strategy != "no_shard" else 1)
        device -= est.optimizer
        host += est.optimizer + 4 * shard
    if "act" in offload.split("+") and layers > 1:
        e = layer_activation_elements(cfg.model, cfg.parallel, 1)
        moved = (layers - 1) * (e["act"] * cfg.model.params_dtype.itemsize
                                + e["fp32"] * 4) * est.in_flight
        device -= moved
        host += moved
    return device, host


def largest(args, strategy: str, offload: str, fits) -> int:
    """The most layers (up to ``--max-layers``) whose prediction ``fits(device, host)``."""
    lo, hi = 0, args.max_layers
    while lo < hi:   # memory grows with the layers: bisect
        mid = (lo + hi + 1) // 2
        if fits(*predict(args, mid, strategy, offload)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (VmRSS: resident now, VmHWM: peak resident,
    VmSize: address space)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _train_two_steps(rank: int, world: int, args, layers: int, strategy: str,
                     offload: str) -> dict:
    """On one rank: peak RSS over start-up while the variant trains 2 steps."""
    import resource

    import torch

    from megalite.optim.build import build_grads_and_optimizer
    from megalite.parallel.state import ParallelState
    from megalite.training.build import default_model_provider

    cfg = _config(args, layers, strategy, offload)
    ps = ParallelState.build(cfg.parallel)
    base = _status("VmRSS")
    limit = _status("VmSize") + int(3 * args.cap_gib * GIB)
    before = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, before[1]))
    try:
        model = default_model_provider(cfg, ps).to(cfg.model.params_dtype)
        grads, optimizer = build_grads_and_optimizer(model, cfg, ps)
        model.train()
        gen = torch.Generator().manual_seed(1234 + rank)
        for _ in range(2):
            ids = torch.randint(0, args.vocab_size, (1, args.seq_length), generator=gen)
            labels = torch.randint(0, args.vocab_size, (1, args.seq_length), generator=gen)
            grads.zero_grad(num_microbatches=1)
            model(ids, labels=labels).float().mean().backward()
            grads.finish_grad_sync()
            optimizer.step()
            grads.finish_param_sync()
        params = sum(p.numel() for p in model.parameters())
        error = None
    except (MemoryError, RuntimeError) as e:   # the address-space limit
        params, error = 0, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
        ps.destroy()
    return {"peak": _status("VmHWM") - base, "params": params, "error": error}


def confirm(args, layers: int, strategy: str, offload: str) -> dict:
    from tools.bench import _ranks

    try:
        out = _ranks.run_on_ranks(_train_two_steps, args.dp, args, layers, strategy, offload,
                                  timeout=1800)
    except _ranks.RankDied as e:   # a rank killed (out of memory) or stuck
        return {"peak": float("inf"), "params": 0, "error": f"{type(e).__name__}: {e}"}
    return {"peak": max(r["peak"] for r in out), "params": out[0]["params"],
            "error": next((r["error"] for r in out if r["error"]), None)}


def _params(args, layers: int, strategy: str) -> float:
    from megalite.planner.memory import estimate_memory

    cfg = _config(args, layers, strategy, "none")
    est = estimate_memory(cfg, args.dp, device_type="cpu")
    return est.params_elements   # this rank's (= the whole model's at tp 1, pp 1)


def _variants(args) -> tuple[list[tuple[str, str]], list[str]]:
    from megalite.config import ConfigError

    out, refused = [], []
    for strategy in SHARDING_STRATEGIES:
        for offload in OFFLOADS:
            try:
                _config(args, 2, strategy, offload)
            except ConfigError as e:
                refused.append(f"{strategy} / {offload}: {e}")
                continue
            out.append((strategy, offload))
    return out, refused


def main(argv: list[str]) -> dict:
    """Print the table; return its rows, ``{(strategy, offload): {"cap", "cpu", "gpu":
    predicted layers, "confirmed": layers or None, "peak": measured bytes or None}}``."""
    p = argparse.ArgumentParser(prog="benchmark.py largest-model")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--cap-gib", type=float, default=2.0)
    p.add_argument("--machine-gib", type=float, default=24.0)
    p.add_argument("--max-layers", type=int, default=4096)
    p.add_argument("--no-confirm", dest="confirm", action="store_false")
    p.add_argument("--only", nargs="*", default=None, metavar="STRATEGY/OFFLOAD",
                   help="run these variants only (e.g. optim/none optim_grads/opt+act)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    variants, refused = _variants(args)
    cap, machine = args.cap_gib * GIB, args.machine_gib * GIB
    print(f"largest GPT (hidden {args.hidden_size}, seq {args.seq_length}, vocab "
          f"{args.vocab_size}, bf16, Adam, micro-batch 1) on dp {args.dp}: layers (parameters, "
          f"millions); 'cpu' caps "
          f"device + host bytes (this machine: no accelerator), 'gpu' caps device bytes only")
    for line in refused:
        print(f"  not run: {line}")
    print(f"{'strategy':>18} {'offload':>8} | {'pred ' + f'{args.cap_gib:g}G cpu':>16} "
          f"{'measured (pred) GiB':>20} {'confirmed':>16} | "
          f"{f'{args.machine_gib:g}G/{args.dp} cpu':>16} {'calibrated':>16} "
          f"{f'{args.machine_gib:g}G gpu':>16}")

    def show(n, strategy):
        return f"{n} ({_params(args, n, strategy) / 1e6:.0f}M)" if n else "-"

    rows = {}
    for strategy, offload in variants:
        if args.only is not None and f"{strategy}/{offload}" not in args.only:
            continue
        under_cap = largest(args, strategy, offload, lambda d, h: d + h <= cap)
        on_cpu = largest(args, strategy, offload, lambda d, h: d + h <= machine / args.dp)
        on_gpu = largest(args, strategy, offload, lambda d, h: d <= machine)
        measured, confirmed, calibrated = "-", "-", "-"
        row = rows[(strategy, offload)] = {"cap": under_cap, "cpu": on_cpu, "gpu": on_gpu,
                                           "confirmed": None, "peak": None}
        if args.confirm and under_cap:
            layers = under_cap
            for _ in range(5):
                got = confirm(args, layers, strategy, offload)
                measured = (f"{got['peak'] / GIB:.2f}" if got["peak"] != float("inf")
                            else "killed")
                if got["error"] is None and got["peak"] <= cap:
                    confirmed = show(layers, strategy)
                    row.update(confirmed=layers, peak=got["peak"])
                    pred = sum(predict(args, layers, strategy, offload))
                    measured += f" ({pred / GIB:.2f})"
                    ratio = got["peak"] / pred   # what the planner leaves out on a CPU
                    calibrated = show(largest(args, strategy, offload, lambda d, h: (
                        d + h) * ratio <= machine / args.dp), strategy)
                    break
                # next: scaled by how far over the cap it went, at least one layer less
                over = got["peak"] / cap if got["peak"] != float("inf") else 2.0
                layers = min(layers - 1, int(layers / over))
                if layers < 1:
                    break
        print(f"{strategy:>18} {offload:>8} | {show(under_cap, strategy):>16} "
              f"{measured:>20} {confirmed:>16} | {show(on_cpu, strategy):>16} "
              f"{calibrated:>16} {show(on_gpu, strategy):>16}", flush=True)
    return rows
