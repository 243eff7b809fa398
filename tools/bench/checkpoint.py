"""Checkpoint save/load throughput and the training stall of sync vs async saves.

``python tools/benchmark.py checkpoint [--size-mb 1000] [--stall-mb 100] [--dir DIR]``

1. Throughput (one process): a Llama-style GPTModel of about ``--size-mb`` MB of fp32
   weights, saved and loaded with megalite's checkpoint (DCP, fsynced, manifest with
   sizes and fast checksums, verified at load; also without verification and the
   checksum alone) against raw ``torch.save`` / ``torch.load`` of the same state dict
   (fsynced too), in MB/s. Loads read back what was just written, so they come from the page cache
   (this machine cannot drop it for one process), as on a node that just saved.
   Async: how long ``save()`` blocks (staging copy + planning) and when the background
   write is published.
2. Stall: a smaller model (``--stall-mb``, weights + Adam state) trains; per mode (after
   a warm-up save): the time the loop spends inside the save call, the wait for the
   write at the next save (finalize), the step time of the ``--steps`` steps that follow
   (they share the CPU with an async write), and the net cost: wall time of save + steps
   minus the same steps without saving.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch


def _model_config(target_mb: float, seq: int = 128):
    """A Llama-like config whose fp32 weights take about ``target_mb`` MB."""
    from megalite.config import ModelConfig

    hidden = 1024 if target_mb >= 400 else 512
    ffn = int(hidden * 8 / 3) // 64 * 64
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    vocab = 32000
    layers = max(1, round((target_mb * 2 ** 20 / 4 - 2 * vocab * hidden) / per_layer))
    return ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                       num_attention_heads=hidden // 64, seq_length=seq, vocab_size=vocab,
                       normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                       add_bias_linear=False, untie_embeddings_and_output_weights=True,
                       hidden_dropout=0.0, attention_dropout=0.0, attention_backend="sdpa")


def _mb(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 20


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _torch_save(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def throughput(args, root: str) -> None:
    from megalite.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint
    from megalite.checkpoint.consolidated import single_process_state
    from megalite.checkpoint.files import FAST_CHECKSUM, iteration_dir, manifest_entries
    from megalite.models.gpt import GPTModel

    ps = single_process_state()
    model = GPTModel(_model_config(args.size_mb), ps, seed=1)
    size = _mb(model)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{size:.0f} MB fp32 (weights only)")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    raw, ckpt = os.path.join(root, "raw.pt"), os.path.join(root, "ckpt")
    saver = CheckpointSaver(ps, async_save=True)
    times: dict[str, list[float]] = {}
    for i in range(args.repeat):
        def record(name, fn):
            times.setdefault(name, []).append(_timed(fn))

        record("torch.save (fsync)", lambda: _torch_save(state, raw))
        record("torch.load", lambda: torch.load(raw, weights_only=True))
        os.remove(raw)
        record("megalite save (sync)", lambda: save_checkpoint(
            ckpt, 2 * i, model, None, None, ps, {}, 0, save_optim=False, save_rng=False))
        record("megalite load", lambda: load_checkpoint(
            ckpt, model, None, None, ps, load_rng=False))
        record("megalite load (--no-ckpt-verify)", lambda: load_checkpoint(
            ckpt, model, None, None, ps, load_rng=False, verify=False))
        written = iteration_dir(ckpt, 2 * i)
        record(f"  {FAST_CHECKSUM} of its files", lambda d=written: manifest_entries(
            d, sorted(n for n in os.listdir(d) if n != "metadata.json")))
        record("megalite async: save() blocks", lambda: saver.save(
            ckpt, 2 * i + 1, model, None, None, {}, 0, save_optim=False, save_rng=False))
        times.setdefault("megalite async: total (write, publish)", []).append(
            times["megalite async: save() blocks"][-1] + _timed(saver.finalize))
        shutil.rmtree(ckpt)
    saver.close()
    print(f"{'best of ' + str(args.repeat):40s} {'seconds':>8s} {'MB/s':>8s}")
    for name, values in times.items():
        print(f"{name:40s} {min(values):8.2f} {size / min(values):8.0f}")


def stall(args, root: str) -> None:
    from megalite.checkpoint import CheckpointSaver
    from megalite.config import MegaliteConfig, TrainConfig
    from megalite.config import DataConfig, OptimConfig
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from megalite.training.loop import TrainState, save, train_step

    mcfg = _model_config(args.stall_mb, seq=16)
    cfg = MegaliteConfig(model=mcfg, optim=OptimConfig(lr=1e-4),
                         data=DataConfig(mock_data=True, tokenizer_type="NullTokenizer"),
                         train=TrainConfig(micro_batch_size=1, global_batch_size=1,
                                           train_iters=100, eval_iters=0))
    cfg.checkpoint.save = os.path.join(root, "stall")
    cfg.logging.log_interval = 10 ** 6
    cfg.validate(1)
    c = build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)
    data = c.train_iterator(0)
    state = TrainState()

    def step() -> float:
        batches = [next(data)]
        start = time.perf_counter()
        train_step(c, batches, state.iteration + 1)
        state.iteration += 1
        return time.perf_counter() - start

    for _ in range(2):
        step()
    print(f"stall model: {_mb(c.model):.0f} MB weights (+2x Adam state)")
    for mode in ("sync", "async"):
        saver = CheckpointSaver(c.ps, async_save=mode == "async")
        c.cfg.checkpoint.async_save = mode == "async"
        save(c, state, saver)          # warm-up: allocates the async staging buffers
        saver.finalize()
        plain = sum(step() for _ in range(args.steps)) / args.steps   # baseline, just before
        start = time.perf_counter()
        blocked = _timed(lambda s=saver: save(c, state, s))
        steps = [step() for _ in range(args.steps)]
        waited = _timed(saver.finalize)
        overhead = time.perf_counter() - start - args.steps * plain
        saver.close()
        print(f"{mode:5s} save: blocked {blocked * 1e3:6.0f} ms in save() + "
              f"{waited * 1e3:5.0f} ms waiting at the next save; the {args.steps} steps "
              f"after it: {sum(steps) / args.steps * 1e3:4.0f} ms/step (without a save: "
              f"{plain * 1e3:4.0f}); net cost of the save: {overhead * 1e3:6.0f} ms")
    c.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=1000.0)
    p.add_argument("--stall-mb", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2, help="throughput runs (best is shown)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = tempfile.mkdtemp(prefix="megalite-ckpt-bench-", dir=args.dir)
    try:
        throughput(args, root)
        stall(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
