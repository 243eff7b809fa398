"""``--profile``: a torch.profiler trace of a few training iterations per profiled rank.

Ranks in ``--profile-ranks`` (global ranks, default ``[0]``) record the iterations run
while ``--profile-step-start <= iterations done < --profile-step-end`` (the defaults 10 and
12 record iterations 11 and 12 of the log), each wrapped in a ``megalite/iteration N``
range. When the last one ends, the trace is written with
``torch.profiler.tensorboard_trace_handler`` as ``rank{R}.<time>.pt.trace.json`` under
``--tensorboard-dir`` (else ``SAVE/profile``, else ``./profile``): a Chrome-trace JSON that
TensorBoard's profiler plugin, Perfetto (ui.perfetto.dev) or chrome://tracing open.
``--use-pytorch-profiler`` is accepted for Megatron scripts; torch.profiler is the only
profiler here (there is no nsys path). As in Megatron-LM, the trace records operators
and their times; tensor shapes (``record_shapes``) only with
``--pytorch-profiler-collect-shapes`` and Python call stacks (``with_stack``) only with
``--pytorch-profiler-collect-callstack``.

Stopping safely. The profiler records operators of every thread, and stopping it (which
also writes the trace, in the trace handler) while another thread is inside a recorded
operator is a race inside torch: with ``record_shapes`` the export has crashed the process
with SIGSEGV (pytorch/pytorch#72858, and kineto when start and stop are on different
threads). At the end of a training iteration such threads exist: under
``--overlap-param-gather`` the all-gathers of the updated parameters run in gloo's / NCCL's
worker threads until the next forward waits for them. So the profiler is started and
stopped on the training thread only, and before it stops it calls ``before_stop`` (the
loop passes ``DataParallelGrads.wait_param_sync``: waits for this rank's gathers in
flight, no collective of its own), which leaves no operator running in another thread.

    with StepProfiler.from_config(cfg, ps.rank, ps.device, grads.wait_param_sync) as profiler:
        # exit: writes a cut-short trace; CUDA kernels only when ps.device is a GPU
        with profiler.iteration(done):    # done = iterations finished before this one
            train_step(...)
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch


def profiler_activities(device) -> list:
    """What torch.profiler records on ``device`` (the rank's chosen device): the CPU, plus
    CUDA kernels only on a CUDA device (a ``--device cpu`` run on a GPU host must not
    start CUPTI or a CUDA context)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def profile_dir(cfg) -> str:
    """Where traces go: --tensorboard-dir, else SAVE/profile, else ./profile."""
    if cfg.logging.tensorboard_dir:
        return cfg.logging.tensorboard_dir
    if cfg.checkpoint.save:
        return os.path.join(cfg.checkpoint.save, "profile")
    return "profile"


class StepProfiler:
    """Records iterations ``[start, end)`` (0-based: iterations done before each) on an
    enabled rank; a no-op elsewhere."""

    def __init__(self, enabled: bool, start: int, end: int, out_dir: str, rank: int,
                 device: torch.device | str = "cpu", before_stop: Callable[[], None] | None = None,
                 record_shapes: bool = False, with_stack: bool = False):
        self.enabled, self.start, self.end = enabled, start, end
        self.out_dir, self.rank, self.device = out_dir, rank, torch.device(device)
        self.before_stop = before_stop
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self._prof: torch.profiler.profile | None = None
        self._thread: int | None = None
        self.trace_written = False

    @classmethod
    def from_config(cls, cfg, rank: int, device: torch.device | str = "cpu",
                    before_stop: Callable[[], None] | None = None) -> StepProfiler:
        lg = cfg.logging
        return cls(lg.profile and rank in lg.profile_ranks, lg.profile_step_start,
                   lg.profile_step_end, profile_dir(cfg), rank, device, before_stop,
                   lg.pytorch_profiler_collect_shapes, lg.pytorch_profiler_collect_callstack)

    def _begin(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        activities = profiler_activities(self.device)
        handler = torch.profiler.tensorboard_trace_handler(self.out_dir,
                                                           worker_name=f"rank{self.rank}")
        self._prof = torch.profiler.profile(activities=activities,
                                            record_shapes=self.record_shapes,
                                            with_stack=self.with_stack, on_trace_ready=handler)
        self._thread = threading.get_ident()
        self._prof.start()

    @contextlib.contextmanager
    def iteration(self, done: int):
        """Context of the iteration that follows ``done`` finished ones."""
        if (self.enabled and self._prof is None and not self.trace_written
                and self.start <= done < self.end):
            self._begin()
        if self._prof is None:
            yield
            return
        with torch.profiler.record_function(f"megalite/iteration {done + 1}"):
            yield
        if done + 1 >= self.end:
            self.close()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording and write the trace (if recording): on the thread that started
        it, after ``before_stop`` (see the module docstring)."""
        if self._prof is None:
            return
        if threading.get_ident() != self._thread:
            raise RuntimeError("the profiler must be stopped on the thread that started it")
        prof, self._prof = self._prof, None
        try:
            if self.before_stop is not None:
                self.before_stop()   # no operator left running in another thread
        finally:
            prof.stop()  # calls the trace handler
            self.trace_written = True
