"""Checkpoint save/load throughput and the training stall of sync vs async saves.

``python tools/benchmark.py checkpoint [--size-mb 1000] [--stall-mb 100] [--dir DIR]``

1. Throughput (one process): a Llama-style GPTModel of about ``--size-mb`` MB of fp32
   weights, saved and loaded with megalite's checkpoint (DCP, fsynced, manifest with
   sizes), each with and without the files' fast checksums (computed at save while the
   files are fsynced, verified at load by a thread beside DCP's read:
   :mod:`megalite.checkpoint.verify`; the two settings alternate within every repeat,
   medians are shown, and the overhead as the ratio of medians and as the median of the
   per-repeat ratios; the budget is 5%), the checksum alone (what the load's thread
   hashes, timed on its own), and raw ``torch.save`` / ``torch.load`` of the
   same state dict (fsynced too), in MB/s; ``--load-pairs`` loads of each kind per
   repeat. Those read back what was just written, so they come from the page cache, as
   on a node that just saved; ``--disk-pairs`` loads of each kind per repeat come from
   the disk, as after a restart on another node (the files are dropped from the page
   cache first with ``posix_fadvise(DONTNEED)``; Linux).
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
import statistics
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


def _drop_from_page_cache(iter_dir: str) -> None:
    """Evict an iteration's files from the page cache (they are fsynced: clean pages)."""
    for name in os.listdir(iter_dir):
        fd = os.open(os.path.join(iter_dir, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def throughput(args, root: str) -> None:
    """Save and load times with and without the files' fast checksums (the default
    integrity check): each repeat runs both settings, in alternating order, so a busy
    machine slows both alike; medians over repeats, and the median of the per-repeat
    ratios."""
    from megalite.checkpoint import CheckpointSaver, LoadOptions, load_checkpoint
    from megalite.checkpoint.consolidated import single_process_state
    from megalite.checkpoint.files import FAST_CHECKSUM, iteration_dir, manifest_entries
    from megalite.models.gpt import GPTModel

    start_load = os.getloadavg()[0]
    ps = single_process_state()
    model = GPTModel(_model_config(args.size_mb), ps, seed=1)
    size = _mb(model)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{size:.0f} MB fp32 (weights only)")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    raw, ckpt = os.path.join(root, "raw.pt"), os.path.join(root, "ckpt")
    savers = {on: CheckpointSaver(ps, checksums=on) for on in (True, False)}
    async_saver = CheckpointSaver(ps, async_save=True)
    times: dict[str, list[float]] = {}

    def record(name, fn):
        times.setdefault(name, []).append(_timed(fn))

    save_name = {True: f"megalite save ({FAST_CHECKSUM} checksums)",
                 False: "megalite save (no checksums)"}
    load_name = {True: f"megalite load ({FAST_CHECKSUM} verified)",
                 False: "megalite load (--no-ckpt-verify)"}
    disk_name = {True: f"megalite load from disk ({FAST_CHECKSUM})",
                 False: "megalite load from disk (no verify)"}
    disk_pairs = args.disk_pairs if hasattr(os, "posix_fadvise") else 0
    iteration = 0
    for i in range(args.repeat):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            iteration += 1
            record(save_name[on], lambda it=iteration, s=savers[on]: s.save(
                ckpt, it, model, None, None, {}, 0, save_optim=False, save_rng=False))
        verified = iteration - (0 if order[-1] else 1)     # the checksummed save
        verified_dir = iteration_dir(ckpt, verified)
        for names, pairs, from_disk in ((load_name, args.load_pairs, False),
                                        (disk_name, disk_pairs, True)):
            for pair in range(pairs):
                for on in (order if pair % 2 == 0 else order[::-1]):
                    if from_disk:
                        _drop_from_page_cache(verified_dir)
                    record(names[on], lambda on=on: load_checkpoint(
                        ckpt, model, None, None, ps,
                        LoadOptions(load_rng=False, verify=on, iteration=verified)))
        record(f"  {FAST_CHECKSUM} of the files alone", lambda: manifest_entries(
            verified_dir, sorted(n for n in os.listdir(verified_dir) if n != "metadata.json")))
        record("torch.save (fsync)", lambda: _torch_save(state, raw))
        record("torch.load", lambda: torch.load(raw, weights_only=True))
        os.remove(raw)
        record("megalite async: save() blocks", lambda it=iteration + 1: async_saver.save(
            ckpt, it, model, None, None, {}, 0, save_optim=False, save_rng=False))
        times.setdefault("megalite async: total (write, publish)", []).append(
            times["megalite async: save() blocks"][-1] + _timed(async_saver.finalize))
        iteration += 1
        shutil.rmtree(ckpt)
    async_saver.close()
    print(f"{'over ' + str(args.repeat) + ' repeats':42s} {'median s':>9s} {'min s':>7s} "
          f"{'MB/s':>7s}   (loads: {args.load_pairs} pairs per repeat)")
    for name, values in times.items():
        print(f"{name:42s} {_median(values):9.3f} {min(values):7.3f} "
              f"{size / _median(values):7.0f}")
    for what, names in (("save", save_name), ("load", load_name),
                        ("load from disk", disk_name)):
        if names[True] not in times:
            continue
        on, off = times[names[True]], times[names[False]]
        paired = _median([a / b - 1 for a, b in zip(on, off)])
        print(f"checksum overhead on {what}: {100 * (_median(on) / _median(off) - 1):+.1f}% "
              f"(medians), {100 * paired:+.1f}% (median of the {len(on)} paired runs)")
    print(f"load average {start_load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
          f"({os.cpu_count()} cores): other work on the machine makes these noisy")


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
    p.add_argument("--repeat", type=int, default=5,
                   help="throughput runs (medians and minima are shown)")
    p.add_argument("--load-pairs", type=int, default=3,
                   help="verified / unverified loads per repeat (alternating; cheap "
                        "next to the saves, and the paired overhead needs many)")
    p.add_argument("--disk-pairs", type=int, default=2,
                   help="verified / unverified loads from the disk per repeat (the files "
                        "dropped from the page cache first)")
    p.add_argument("--no-stall", action="store_true", help="throughput only")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = tempfile.mkdtemp(prefix="megalite-ckpt-bench-", dir=args.dir)
    try:
        throughput(args, root)
        if not args.no_stall:
            stall(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
