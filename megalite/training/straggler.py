"""Stragglers (``--log-straggler``): every log interval, each rank's step time and its
split, gathered over the world, and the slowest ranks named with how much slower they are.

In synchronous training every rank's step takes about as long (each waits for the slowest
in the collectives), so ranks are ranked by their *busy* time: step time minus the time
blocked in collectives (``comm``). The straggler is the rank whose peers wait for it.

Per rank and log interval (milliseconds per iteration):

- ``step``: the whole training step (the loop's iteration time);
- ``forward_backward`` and ``optimizer``: the loop's timers of those names (the detector
  enables them; on CUDA they synchronize the device);
- ``comm``: time spent blocked in megalite's collectives (the flight recorder's
  :attr:`~megalite.parallel.watchdog.FlightRecorder.comm_seconds`; part of the two above).
  A rank that waits for a slow peer shows a long ``comm``; the straggler itself a short one.

One ``all_gather_object`` over the world every log interval (all ranks call
:meth:`StragglerDetector.after_iteration` every iteration). The logging rank prints

    straggler | iteration 20 | busy (ms/iter) min 21.2 (rank 1) median 57.1 max 93.0
    (rank 0) | slowest: rank 0 93.0 ms (+63% vs median; step 95.1: fwd-bwd 80.1,
    optimizer 1.2, comm 2.1) | fastest: rank 1 21.2 ms

and the JSONL object of that iteration carries ``straggler``: ``{"busy_ms": [per rank],
"step_ms": [...], "forward_backward_ms": [...], "optimizer_ms": [...], "comm_ms": [...],
"slowest": [[rank, busy ms], ...], "fastest": [...], "slowest_vs_median": 1.63}``.
``--straggler-minmax-count N`` names N slowest and fastest ranks;
``--disable-straggler-on-startup`` leaves out the first log interval (start-up).
"""

from __future__ import annotations

import statistics

from megalite.parallel.collectives import all_gather_object
from megalite.parallel.watchdog import RECORDER

TIMERS = ("forward-backward", "optimizer")


class StragglerDetector:
    """Accumulates this rank's times over a log interval and reports them (see module
    doc). ``enabled`` False makes every method a no-op (no collective)."""

    def __init__(self, enabled: bool, log_interval: int, minmax_count: int = 1,
                 skip_first: bool = False, timers=None):
        self.enabled = enabled
        self.log_interval = log_interval
        self.count = minmax_count
        self.skip_first = skip_first
        self.timers = timers
        self._step_s = 0.0
        self._iters = 0
        self._last = {name: 0.0 for name in TIMERS}
        self._last_comm = RECORDER.comm_seconds
        self._intervals = 0
        if enabled and timers is not None:
            for name in TIMERS:        # create them enabled, whatever --timing-log-level
                timers(name, log_level=0)

    @classmethod
    def from_config(cls, cfg, timers=None) -> StragglerDetector:
        p = cfg.parallel
        return cls(p.log_straggler, cfg.logging.log_interval, p.straggler_minmax_count,
                   p.disable_straggler_on_startup, timers)

    def _since_last(self) -> dict[str, float]:
        """Seconds of each timer and of communication since the last report."""
        out = {}
        for name in TIMERS:
            total = self.timers(name).elapsed(reset=False) if self.timers else 0.0
            # the loop's timer summary resets them at its log interval, after this reads
            out[name] = total - self._last[name] if total >= self._last[name] else total
            self._last[name] = total
        comm = RECORDER.comm_seconds
        out["comm"] = comm - self._last_comm
        self._last_comm = comm
        return out

    def after_iteration(self, iteration: int, step_seconds: float) -> dict | None:
        """Add one step; at a log interval, gather every rank's times (collective over
        the world) and return the report (the same on every rank), else None."""
        if not self.enabled:
            return None
        self._step_s += step_seconds
        self._iters += 1
        if iteration % self.log_interval:
            return None
        parts = self._since_last()
        n = max(self._iters, 1)
        mine = [1000.0 * self._step_s / n] + [1000.0 * parts[k] / n for k in (*TIMERS, "comm")]
        self._step_s, self._iters = 0.0, 0
        self._intervals += 1
        rows = all_gather_object(mine)
        if self.skip_first and self._intervals == 1:
            return None
        return report(rows, self.count)


def report(rows: list[list[float]], count: int) -> dict:
    """The straggler report of ``rows`` (rank r: ``[step, forward_backward, optimizer,
    comm]`` ms per iteration), naming ``count`` slowest and fastest ranks by busy time."""
    busy = [round(max(r[0] - r[3], 0.0), 3) for r in rows]
    order = sorted(range(len(rows)), key=lambda r: busy[r])
    k = min(count, len(rows))
    median = statistics.median(busy)
    return {"busy_ms": busy,
            "step_ms": [round(r[0], 3) for r in rows],
            "forward_backward_ms": [round(r[1], 3) for r in rows],
            "optimizer_ms": [round(r[2], 3) for r in rows],
            "comm_ms": [round(r[3], 3) for r in rows],
            "slowest": [[r, busy[r]] for r in reversed(order[-k:])],
            "fastest": [[r, busy[r]] for r in order[:k]],
            "slowest_vs_median": round(busy[order[-1]] / median, 3) if median > 0 else None}


def line(iteration: int, rep: dict) -> str:
    """The human line of a report."""
    busy = rep["busy_ms"]
    median = statistics.median(busy)
    lo, hi = rep["fastest"][0], rep["slowest"][0]

    def slow(r, ms):
        pct = 100.0 * (ms / median - 1.0) if median > 0 else 0.0
        return (f"rank {r} {ms:.1f} ms ({pct:+.0f}% vs median; step {rep['step_ms'][r]:.1f}: "
                f"fwd-bwd {rep['forward_backward_ms'][r]:.1f}, optimizer "
                f"{rep['optimizer_ms'][r]:.1f}, comm {rep['comm_ms'][r]:.1f})")

    return (f" straggler | iteration {iteration} | busy (ms/iter) min {lo[1]:.1f} "
            f"(rank {lo[0]}) median {median:.1f} max {hi[1]:.1f} (rank {hi[0]}) | slowest: "
            + ", ".join(slow(r, ms) for r, ms in rep["slowest"])
            + " | fastest: " + ", ".join(f"rank {r} {ms:.1f} ms" for r, ms in rep["fastest"]))
