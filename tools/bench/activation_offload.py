"""Activation offload (``--cpu-offloading``): saved-activation bytes left on the device at
the end of the forward, and step time, for 0 .. L-1 offloaded layers.

``python tools/benchmark.py activation-offload [--num-layers 6] [--hidden-size 256]
[--seq-length 256] [--micro-batch-size 2] [--vocab-size 1024] [--bf16] [--steps 3]``

One process builds the GPT model (GPT-2 style, dropout 0) once per ``N`` =
``--cpu-offloading-num-layers`` (0: without ``--cpu-offloading``) and runs ``--steps``
forward + backward passes on a random batch after one warm-up pass. During the forward a
:class:`megalite.transformer.activation_offload.SavedActivationLedger` counts the distinct
storages autograd saved for backward (parameters excluded): ``resident`` (left on the
device), ``offloaded`` (copied to the host). On this CPU-only host both are host memory:
what is measured is which storages the autograd graph keeps on the compute device, the
bytes a GPU run would hold there; the copies are real (the same code path as on CUDA, minus
the side stream and pinning), so the step time shows their cost on a CPU.

The formula: ``resident(N) = resident(0) - N x layer bytes``, with the layer bytes
measured on the plain run (the storages one layer saves, of at least ``MIN_OFFLOAD_BYTES``:
smaller ones such as norm statistics stay). ``planner``: the planner's per-layer estimate
(``megalite.planner.memory``) for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

MIB = 2.0 ** 20


def _model(args, n: int):
    from megalite.config import ModelConfig, ParallelConfig
    from megalite.models.gpt import GPTModel
    from megalite.parallel.state import ParallelState

    extra = {"cpu_offloading": True, "cpu_offloading_num_layers": n} if n else {}
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=max(1, args.hidden_size // 64),
                      seq_length=args.seq_length,
                      vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0,
                      attention_backend="sdpa", bf16=args.bf16, **extra)
    ps = ParallelState.build(ParallelConfig())
    model = GPTModel(cfg, ps, seed=1)
    return cfg, model.to(cfg.params_dtype)


def _batch(cfg, mb: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_length + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _layer_bytes(cfg, model, mb: int) -> int:
    """Bytes layer 0 saves for backward in a plain forward, counting what offload copies."""
    from megalite.transformer.activation_offload import MIN_OFFLOAD_BYTES, SavedActivationLedger

    ledger = SavedActivationLedger(model.parameters())
    layer, hooks = model.decoder.layers["0"], ledger.hooks()
    pre = layer.register_forward_pre_hook(lambda *_: hooks.__enter__())
    post = layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    ids, labels = _batch(cfg, mb)
    model(ids, labels=labels)
    pre.remove()
    post.remove()
    return sum(b for b in ledger.kept.values() if b >= MIN_OFFLOAD_BYTES)


def _measure(args, n: int) -> dict:
    from megalite.transformer.activation_offload import SavedActivationLedger

    cfg, model = _model(args, n)
    ids, labels = _batch(cfg, args.micro_batch_size)
    out = {"layer_bytes": _layer_bytes(cfg, model, args.micro_batch_size) if n == 0 else None}
    times = []
    for step in range(args.steps + 1):
        ledger = SavedActivationLedger(model.parameters())
        if model.decoder.offload is not None:
            model.decoder.offload.ledger = ledger
        start = time.perf_counter()
        with ledger.hooks():
            loss = model(ids, labels=labels).float().mean()
        loss.backward()
        if step:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    out.update(resident=ledger.kept_bytes, offloaded=ledger.offloaded_bytes,
               step=sorted(times)[len(times) // 2], cfg=cfg)
    return out


def _planner_layer_bytes(cfg, mb: int) -> float:
    from megalite.config import ParallelConfig
    from megalite.planner.memory import layer_activation_elements

    e = layer_activation_elements(cfg, ParallelConfig(), mb)
    return e["act"] * cfg.params_dtype.itemsize + e["fp32"] * 4


def main(argv: list[str]) -> dict:
    """Print the table; return its rows, ``{N: {"resident", "offloaded", "step", ...}}``
    (bytes, seconds; N = 0 also holds ``layer_bytes``)."""
    p = argparse.ArgumentParser(prog="benchmark.py activation-offload")
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = {n: _measure(args, n) for n in range(args.num_layers)}
    base = rows[0]
    layer = base["layer_bytes"]
    print(f"activation offload: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"{'bf16' if args.bf16 else 'fp32'}; one layer "
          f"saves {layer / MIB:.2f} MiB offloadable (planner's estimate "
          f"{_planner_layer_bytes(base['cfg'], args.micro_batch_size) / MIB:.2f} MiB); "
          f"median of {args.steps} steps")
    print(f"{'N':>3} {'resident MiB':>13} {'formula MiB':>12} {'resident/formula':>17} "
          f"{'offloaded MiB':>14} {'step ms':>9} {'x plain':>8}")
    for n, r in rows.items():
        formula = base["resident"] - n * layer
        print(f"{n:>3} {r['resident'] / MIB:>13.2f} {formula / MIB:>12.2f} "
              f"{r['resident'] / formula:>17.4f} {r['offloaded'] / MIB:>14.2f} "
              f"{r['step'] * 1e3:>9.1f} {r['step'] / base['step']:>8.2f}")
    return rows
