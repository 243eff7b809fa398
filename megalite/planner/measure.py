"""Measured peak memory of a real run on CPU, the same way for every layout.

The allocation tracker is the PyTorch profiler's memory view: with ``profile_memory`` it
records every allocation and free of the CPU allocator (bytes, time). The peak of a
stretch of code is the highest running sum of those events, added to the bytes already
live when the stretch starts (``baseline``, counted by the caller from the storages it
knows of: parameters, gradient buffers, optimizer state). Every tensor counts, views once
(they allocate nothing), whoever allocates it: activations saved for backward, transient
logits, communication buffers, the optimizer's temporaries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_allocated(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under the profiler; (its result, peak bytes allocated above the bytes
    live at the start). Frees of memory allocated before the start count as negative, so
    the figure is the peak of the change in live bytes (never below 0)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def measure_training_peak(cfg, iterations: int = 1) -> dict:
    """Build ``cfg`` in this process's world (gloo ranks already initialized) as
    ``pretrain_gpt.py`` does, train ``iterations`` steps, and return this rank's
    ``{"peak": bytes, "baseline": bytes, "params": elements, "pp_rank": int}``: ``peak`` is
    the highest number of bytes live during training (baseline + profiler peak), where
    ``baseline`` are the parameters, gradient buffers and optimizer state present after
    the build (:func:`megalite.optim.memory.rank_memory`)."""
    import copy

    from megalite.optim.memory import rank_memory
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from megalite.training.loop import train

    cfg = copy.deepcopy(cfg)
    cfg.train.train_iters = iterations
    ps = ParallelState.build(cfg.parallel)
    c = build_components(cfg, ps, peak_probe_seconds=0.0)
    try:
        mem = rank_memory(c.model, c.grads, c.optimizer)
        baseline = mem.params + mem.grads + mem.optimizer
        _, peak = peak_allocated(lambda: train(c))
        out = {"peak": baseline + peak, "baseline": baseline, "params": mem.num_params,
               "param_bytes": mem.params, "grad_bytes": mem.grads,
               "optim_bytes_built": mem.optimizer, "pp_rank": ps.pp.rank,
               "tp_rank": ps.tp.rank}
        after = rank_memory(c.model, c.grads, c.optimizer)
        out["optim_bytes"] = after.optimizer
    finally:
        c.close()
        ps.destroy()
    return out
