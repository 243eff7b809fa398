"""``--manual-gc``: Python's garbage collector off, collections at chosen iterations.

Automatic collection pauses whichever rank happens to cross a threshold, and the others
wait for it at the next collective. Under ``--manual-gc`` the automatic collector is
disabled for the run (and re-enabled after, if it was on) and ``gc.collect()`` runs on
every rank at the same points: after each iteration that is a multiple of
``--manual-gc-interval`` (0: never), and before and after each evaluation unless
``--no-manual-gc-eval``.

    with ManualGC.from_config(cfg.train) as manual_gc:
        ...; manual_gc.after_iteration(iteration)
        manual_gc.around_eval(); evaluate(...); manual_gc.around_eval()
"""

from __future__ import annotations

import gc


class ManualGC:
    """``collected_at`` lists where it collected (iteration numbers; ``"eval"`` entries
    around evaluations) for logs and tests."""

    def __init__(self, enabled: bool, interval: int, at_eval: bool):
        self.enabled, self.interval, self.at_eval = enabled, interval, at_eval
        self.collected_at: list = []
        self._was_enabled = True

    @classmethod
    def from_config(cls, train_cfg) -> ManualGC:
        t = train_cfg
        return cls(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval)

    def __enter__(self) -> ManualGC:
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()
            self.collected_at.append(iteration)

    def around_eval(self) -> None:
        if self.enabled and self.at_eval:
            gc.collect()
            self.collected_at.append("eval")
