"""Progress of long work on stderr, on a terminal and in a log file alike.

On a terminal, :class:`Progress` is a tqdm bar. Where stderr is not a terminal (a SLURM
log, a pipe) a bar's carriage returns would fill the file, so it writes plain lines
instead::

    evaluate: 40% (12/30 micro-batches, 8 s)
    convert: 50% (1/2 steps, 9 s), saving the checkpoint

none in the first ``delay`` seconds (work that quick prints nothing, as the bar shows
nothing), then one whenever another ``every_percent`` percent is done or ``interval``
seconds have passed since the last one, and a last one when the work ends; at most
``100 / every_percent + 2`` lines plus one per ``interval`` seconds. The environment
variables ``MEGALITE_PROGRESS_DELAY`` and ``MEGALITE_PROGRESS_INTERVAL`` (seconds) change
the defaults of 2 and 30 s. Used by checkpoint conversion, evaluation, the generation
server's start, the layout planner's search and the dataset index build.
"""

from __future__ import annotations

import os
import sys
import time

DEFAULT_DELAY = 2.0
DEFAULT_INTERVAL = 30.0


def _seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


def plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("ch", "sh", "s", "x")) else "s")


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class Progress:
    """Counts ``total`` units of work (``None``: unknown) named ``desc``; ``unit`` in the
    singular (lines use its :func:`plural`). tqdm's calls: :meth:`update`,
    :meth:`set_postfix_str`, :meth:`close`, a context manager, and iteration over
    ``iterable``. ``disable``: nothing at all (``--no-progress``, ranks other than the one
    that reports)."""

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "step", *,
                 iterable=None, stream=None, disable: bool = False, delay: float | None = None,
                 interval: float | None = None, every_percent: float = 10.0,
                 leave: bool = True) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.disable = disable
        self.delay = _seconds("MEGALITE_PROGRESS_DELAY", DEFAULT_DELAY) if delay is None \
            else delay
        self.interval = _seconds("MEGALITE_PROGRESS_INTERVAL", DEFAULT_INTERVAL) \
            if interval is None else interval
        self.every_percent = every_percent
        self.n, self.postfix = 0, ""
        self.start = time.monotonic()
        self.lines = 0                    # plain lines written
        self._last_time: float | None = None
        self._last_n = -1
        self.bar = None
        if not disable and _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self.stream,
                            delay=self.delay, leave=leave, dynamic_ncols=True)

    # -- tqdm's interface --------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif not self.disable:
            self._maybe_line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        """What is being done now: the bar's postfix; in plain lines, a line that names it
        when one is due by time (lines written by :meth:`update` say what is done)."""
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=refresh)
        elif not self.disable:
            self._maybe_line(activity=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif not self.disable and self.lines and self.n != self._last_n:
            self._line()
        self.disable = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    # -- plain lines -------------------------------------------------------------------
    def _percent(self, n: int) -> float | None:
        return 100.0 * n / self.total if self.total else None

    def _maybe_line(self, activity: bool = False) -> None:
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        due = self._last_time is None or now - self._last_time >= self.interval
        pct, last = self._percent(self.n), self._percent(max(self._last_n, 0))
        if (pct is not None and self.every_percent > 0 and self._last_time is not None
                and not activity):
            due = due or pct // self.every_percent > last // self.every_percent
        if due:
            self._line(now, activity)

    def _line(self, now: float | None = None, activity: bool = False) -> None:
        now = time.monotonic() if now is None else now
        pct = self._percent(self.n)
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        head = f"{pct:.0f}% " if pct is not None else ""
        tail = f", {self.postfix}" if activity and self.postfix else ""
        print(f"{self.desc}: {head}({count} {plural(self.unit)}, "
              f"{now - self.start:.0f} s){tail}", file=self.stream, flush=True)
        self.lines += 1
        self._last_time, self._last_n = now, self.n
