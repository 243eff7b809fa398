"""Loss scaling for fp16 training.

The loss is multiplied by ``scale`` before backward so small gradients survive fp16; the
optimizer divides the gradients by it again and reports whether any was inf/nan. A step
with non-finite gradients is skipped.

Dynamic scaling: once ``hysteresis`` overflowing steps have been seen since the scale last
grew, every further overflow halves the scale (never below ``min_scale``); after ``window``
consecutive clean steps it doubles and the hysteresis budget refills.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megalite.config import OptimConfig


@dataclass
class ConstantLossScaler:
    """A fixed scale (``--loss-scale``); 1.0 means no scaling (fp32 / bf16)."""

    scale: float = 1.0

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt; overflowing steps are still skipped by the optimizer."""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


@dataclass
class DynamicLossScaler:
    """Halve on overflow (with hysteresis), double after ``window`` clean steps.

    ``hysteresis`` is how many overflows are tolerated before halving: each overflow
    decrements a counter and the scale halves when it reaches zero. As in Megatron-LM the
    counter is not refilled by clean steps, only when the scale grows.
    """

    scale: float = 2.0 ** 32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis_left: int | None = None
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if self.hysteresis_left is None:
            self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step; ``found_inf`` must agree on every rank."""
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def build_loss_scaler(ocfg: OptimConfig, fp16: bool):
    """Dynamic scaler for fp16 unless ``--loss-scale`` fixes it; scale 1 otherwise."""
    if not fp16:
        return ConstantLossScaler(1.0)
    if ocfg.loss_scale is not None:
        return ConstantLossScaler(ocfg.loss_scale)
    return DynamicLossScaler(scale=ocfg.initial_loss_scale, min_scale=ocfg.min_loss_scale,
                             window=ocfg.loss_scale_window, hysteresis=ocfg.hysteresis)
