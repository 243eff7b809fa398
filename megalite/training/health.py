"""Stop fp16 runs whose loss scaling cannot learn (:class:`LossScaleWatchdog`).

Fed after every optimizer step with the step's outcome (updated or skipped), its grad
norm and the loss scale, it raises :class:`LossScaleError` when, for ``WINDOW``
consecutive steps:

(a) a static ``--loss-scale`` overflowed on every step (every step skipped);
(b) the dynamic scale sat at ``--min-loss-scale`` and still overflowed on every step;
(c) every step's gradients were exactly zero (grad norm 0.0) while the loss was finite and
    non-zero: the scaled loss underflowed fp16.

A run that ends before ``WINDOW`` such steps, all of its steps skipped so (a static
scale that overflowed every time, a dynamic one stuck at its minimum), raises the same
error from :meth:`LossScaleWatchdog.at_end` instead of exiting 0 with an untrained model.

``WINDOW`` is fixed at 10 steps (no Megatron flag fits): ``--loss-scale-window`` (1000 by
default) would let a broken run write many checkpoints first, ``--hysteresis`` (2) is too
short to tell a transient overflow from a persistent one. While a dynamic scale is still
backing off from ``--initial-loss-scale`` (2^32 needs ~17 skipped steps to reach usable
values) nothing fires: only overflows *at* the minimum scale count. Runs without loss
scaling (bf16 / fp32) are never watched.

Everything it looks at is identical on all ranks (the inf check and the grad norm are
all-reduced over the world, ``lm_loss`` over data and pipeline parallel, the scaler
updates from the shared inf flag), so every rank raises at the same iteration; the loop
calls it before that iteration's checkpoint.
"""

from __future__ import annotations

import math

from megalite.errors import NumericalError

WINDOW = 10


class LossScaleError(NumericalError):
    """fp16 loss scaling cannot learn (every step skipped, or all gradients zero)."""


class LossScaleWatchdog:
    """``static_scale``: ``--loss-scale`` (None: dynamic scaling down to ``min_scale``)."""

    def __init__(self, fp16: bool, static_scale: float | None, min_scale: float,
                 window: int = WINDOW):
        self.enabled = fp16
        self.static_scale = static_scale
        self.min_scale = min_scale
        self.window = window
        self.skipped = 0        # consecutive skipped steps (static) / at the minimum scale
        self.zero = 0           # consecutive updated steps with grad norm exactly 0
        self.steps = 0          # steps of this run

    @classmethod
    def from_config(cls, cfg) -> LossScaleWatchdog:
        o = cfg.optim
        return cls(cfg.model.fp16, o.loss_scale, o.min_loss_scale)

    def after_step(self, iteration: int, updated: bool, grad_norm: float | None,
                   loss_scale: float, lm_loss: float) -> None:
        """Record one step; raises :class:`LossScaleError` (same on every rank)."""
        if not self.enabled:
            return
        n = self.window
        self.steps += 1
        if updated:
            self.skipped = 0
            if grad_norm == 0.0 and math.isfinite(lm_loss) and lm_loss != 0.0:
                self.zero += 1
            else:
                self.zero = 0
        else:
            self.zero = 0
            stuck = self.static_scale is not None or loss_scale <= self.min_scale
            self.skipped = self.skipped + 1 if stuck else 0
        if self.skipped >= n:
            raise self._overflow_error(iteration, f"the last {n} steps")
        if self.zero >= n:
            if self.static_scale is not None:
                cause = (f"--loss-scale {self.static_scale:g} underflows every gradient to "
                         "zero in fp16; raise it or drop --loss-scale for dynamic loss "
                         "scaling")
            else:
                cause = (f"the loss scale {loss_scale:g} underflows every gradient to zero "
                         "in fp16; raise --initial-loss-scale / --min-loss-scale or use "
                         "--bf16")
            raise LossScaleError(
                f"the gradient norm was exactly 0 on every one of the last {n} steps "
                f"(iterations {iteration - n + 1}-{iteration}, loss {lm_loss:.6g}): {cause}")

    def at_end(self, iteration: int) -> None:
        """At the end of a run: :class:`LossScaleError` when every one of its steps was
        skipped on overflow (fewer than the window: :meth:`after_step` did not fire)."""
        if self.enabled and 0 < self.steps == self.skipped:
            raise self._overflow_error(iteration, f"this run's {self.steps} steps")

    def _overflow_error(self, iteration: int, steps: str) -> LossScaleError:
        """The error for ``self.skipped`` overflowing steps up to ``iteration``."""
        span = f"iterations {iteration - self.skipped + 1}-{iteration}"
        if self.static_scale is not None:
            return LossScaleError(
                f"--loss-scale {self.static_scale:g} is too large: the gradients overflowed "
                f"on every one of {steps} ({span}), so none updated the model; drop "
                "--loss-scale for dynamic loss scaling, lower it, or use --bf16")
        return LossScaleError(
            f"the dynamic loss scale is at --min-loss-scale {self.min_scale:g} and the "
            f"gradients still overflowed on every one of {steps} ({span}); lower "
            "--min-loss-scale or use --bf16")
