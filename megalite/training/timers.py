"""Named wall-clock timers with a log level (``--timing-log-level``).

    timers = Timers(log_level=1)
    with timers("forward-compute", log_level=1):
        ...
    timers.summary(["forward-compute", "backward-compute"], normalizer=iters)

A timer whose level exceeds the configured one is a no-op (no synchronization cost).
Levels: 0 whole iteration; 1 forward / backward / optimizer; 2 communication. On CUDA the
timer synchronizes the device before reading the clock so the numbers mean something.
Each rank times itself; :meth:`Timers.summary` reports this rank's numbers (max over ranks
would need a collective; the loop reports rank 0, which is enough on a symmetric layout).
"""

from __future__ import annotations

import time

import torch
from typing_extensions import Self


class Timer:
    """Accumulates elapsed seconds between start/stop pairs until reset."""

    def __init__(self, name: str, enabled: bool = True, sync_cuda: bool = False):
        self.name = name
        self.enabled = enabled
        self.sync_cuda = sync_cuda
        self._start: float | None = None
        self._total = 0.0

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        if self.enabled:
            if self._start is not None:
                raise RuntimeError(f"timer {self.name!r} started twice")
            self._start = self._now()

    def stop(self) -> None:
        if self.enabled:
            if self._start is None:
                raise RuntimeError(f"timer {self.name!r} stopped without being started")
            self._total += self._now() - self._start
            self._start = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated (including a running interval); optionally reset to 0."""
        total = self._total
        if self._start is not None:
            total += self._now() - self._start
            if reset:
                self._start = self._now()
        if reset:
            self._total = 0.0
        return total

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Timers:
    """A registry of :class:`Timer` objects created on first use."""

    def __init__(self, log_level: int = 0, device: torch.device | None = None):
        self.log_level = log_level
        self.sync_cuda = device is not None and device.type == "cuda"
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int = 0) -> Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = Timer(name, enabled=log_level <= self.log_level, sync_cuda=self.sync_cuda)
            self._timers[name] = timer
        return timer

    def names(self) -> list[str]:
        return [n for n, t in self._timers.items() if t.enabled]

    def ms_per(self, names: list | None = None, normalizer: float = 1.0,
               reset: bool = True) -> dict[str, float]:
        """``{name: ms per normalizer}`` (e.g. per iteration) of the enabled timers."""
        out = {}
        for name in names or self.names():
            timer = self._timers.get(name)
            if timer is not None and timer.enabled:
                out[name] = 1000.0 * timer.elapsed(reset=reset) / max(normalizer, 1e-12)
        return out

    def summary(self, names: list | None = None, normalizer: float = 1.0,
                reset: bool = True) -> str:
        """``"name: 12.34 | other: 5.67"`` in ms per ``normalizer`` (e.g. iterations)."""
        return format_ms(self.ms_per(names, normalizer, reset))


def format_ms(times: dict[str, float]) -> str:
    """``"name: 12.34 | other: 5.67"`` from :meth:`Timers.ms_per`'s dict."""
    return " | ".join(f"{name}: {ms:.2f}" for name, ms in times.items())
