"""Device memory in the log, as Megatron-LM reports it.

On a CUDA device, after the first iteration of a run (the first one this process trains,
also after a resume) every rank prints one line::

    [Rank 3] (after 1 iterations) memory (MB) | allocated: 2042.5 | max allocated: 9817.1 \
        | reserved: 10240.0 | max reserved: 10240.0          (one line; wrapped here)

and on that iteration and every ``--log-interval``-th one after it the metrics file gets
``mem_max_allocated_mb``: the peak allocated memory (``torch.cuda.max_memory_allocated``)
of the rank with the highest peak, MAX over the world group (a one-scalar all-reduce,
every rank takes part). On CPU there is no allocator to ask: nothing is printed and no key
is written.

The numbers come from a *stats source*, a function ``device -> MemoryStats | None``
(:func:`cuda_memory_stats` by default, looked up when the reporter is made); tests pass
or monkeypatch a fake one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megalite.parallel.collectives import ReduceOp, all_reduce_scalar

MB = 1024 * 1024


@dataclass(frozen=True)
class MemoryStats:
    """Device memory of one rank, in bytes."""

    allocated: int
    max_allocated: int
    reserved: int
    max_reserved: int


def cuda_memory_stats(device: torch.device) -> MemoryStats | None:
    """The CUDA caching allocator's counters for ``device``; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return MemoryStats(allocated=torch.cuda.memory_allocated(device),
                       max_allocated=torch.cuda.max_memory_allocated(device),
                       reserved=torch.cuda.memory_reserved(device),
                       max_reserved=torch.cuda.max_memory_reserved(device))


def memory_line(rank: int, iteration: int, stats: MemoryStats) -> str:
    """Megatron's memory report line for ``rank`` after ``iteration`` iterations (MB)."""
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) |"
            f" allocated: {stats.allocated / MB:.1f} |"
            f" max allocated: {stats.max_allocated / MB:.1f} |"
            f" reserved: {stats.reserved / MB:.1f} |"
            f" max reserved: {stats.max_reserved / MB:.1f}")


class MemoryReporter:
    """Prints the memory line once and adds the world's peak to the metrics (see module
    docstring). Call :meth:`after_iteration` on every rank after every iteration."""

    def __init__(self, ps, log_interval: int,
                 stats_source: Callable[[torch.device], MemoryStats | None] | None = None,
                 stream=None):
        self.ps = ps
        self.log_interval = log_interval
        self.stats_source = stats_source or cuda_memory_stats
        self.stream = stream
        self.printed = False

    def after_iteration(self, iteration: int) -> dict:
        """``{"mem_max_allocated_mb": world peak}`` on the run's first iteration and on
        every ``log_interval``-th, else ``{}`` (always ``{}`` off CUDA). Collective over
        the world group on those iterations."""
        if self.printed and iteration % self.log_interval != 0:
            return {}
        stats = self.stats_source(self.ps.device)
        if stats is None:  # the same answer on every rank: one device kind per run
            return {}
        if not self.printed:
            print(memory_line(self.ps.rank, iteration, stats), file=self.stream or sys.stdout,
                  flush=True)
            self.printed = True
        peak = float(stats.max_allocated)
        if self.ps.world_size > 1:
            peak = all_reduce_scalar(peak, None, ReduceOp.MAX, self.ps.device)
        return {"mem_max_allocated_mb": round(peak / MB, 1)}


def tensorboard_memory_scalars(device: torch.device) -> dict[str, float]:
    """``--log-memory-to-tensorboard``'s scalars for this process: on CUDA Megatron-LM's
    four from the caching allocator (bytes, and the count of live allocations); on CPU,
    with no allocator to ask, the process's resident memory and its peak (bytes; Linux's
    /proc, else the peak alone)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024   # bytes on macOS, KiB on Linux
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["mem-resident-bytes"] = int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        pass
    out["mem-max-resident-bytes"] = max(peak, out.get("mem-resident-bytes", 0))
    return out
