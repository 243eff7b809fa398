"""Learning-rate schedules: linear warm-up, then constant / linear / cosine / inverse square
root / WSD (warmup-stable-decay) decay down to ``min_lr``.

Steps count optimizer updates that succeeded (a skipped fp16 step does not advance the
schedule). The learning rate used by update ``k`` (0-based) is ``lr_at(k)``: with warm-up
the first update runs at lr 0, as in Megatron-LM.

    sched = LRScheduler.from_config(cfg.optim, train_iters=cfg.train.train_iters)
    sched.apply(optimizer)       # write lr_at(num_steps) into every param group
    optimizer.step(); sched.step()
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megalite.config import ConfigError, OptimConfig

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine")


@dataclass
class LRScheduler:
    """The learning rate as a pure function of the number of updates done so far."""

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str = "linear"
    wsd_decay_style: str = "exponential"
    wsd_decay_steps: int | None = None
    num_steps: int = 0

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"unknown --lr-decay-style {self.decay_style!r}; "
                              f"choose from {DECAY_STYLES}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"unknown --lr-wsd-decay-style {self.wsd_decay_style!r}")
        if self.decay_style not in ("constant", "inverse-square-root") \
                and self.decay_steps < self.warmup_steps:
            raise ConfigError(f"lr decay iterations ({self.decay_steps}) must not be fewer "
                              f"than the warm-up iterations ({self.warmup_steps})")
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
            if self.wsd_decay_steps > self.decay_steps - self.warmup_steps:
                raise ConfigError(f"--lr-wsd-decay-iters ({self.wsd_decay_steps}) must not "
                                  f"exceed decay iters - warm-up iters "
                                  f"({self.decay_steps - self.warmup_steps})")

    @classmethod
    def from_config(cls, ocfg: OptimConfig, train_iters: int | None) -> LRScheduler:
        """Resolve defaults: decay over ``train_iters`` unless ``--lr-decay-iters`` is given;
        ``--lr-warmup-fraction`` is a fraction of the decay iterations."""
        decay = ocfg.lr_decay_iters or train_iters
        if decay is None:
            if ocfg.lr_decay_style != "constant":
                raise ConfigError("the lr schedule needs --lr-decay-iters or --train-iters")
            decay = max(ocfg.lr_warmup_iters, 1)
        warmup = ocfg.lr_warmup_iters
        if ocfg.lr_warmup_fraction is not None:
            warmup = int(ocfg.lr_warmup_fraction * decay)
        return cls(max_lr=ocfg.lr, min_lr=ocfg.min_lr, warmup_steps=warmup, decay_steps=decay,
                   decay_style=ocfg.lr_decay_style, wsd_decay_style=ocfg.lr_wsd_decay_style,
                   wsd_decay_steps=ocfg.lr_wsd_decay_iters)

    # -- the schedule -------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        """Learning rate of update number ``step`` (0-based)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        if step > self.decay_steps:
            return self.min_lr
        span = self.max_lr - self.min_lr
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                return self.max_lr
            return self.min_lr + span * _decay_coeff(
                self.wsd_decay_style, (step - anneal_start) / self.wsd_decay_steps)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return self.min_lr + span * _decay_coeff(self.decay_style, ratio)

    @property
    def lr(self) -> float:
        """Learning rate of the next update."""
        return self.lr_at(self.num_steps)

    def apply(self, optimizer) -> float:
        """Write the next update's lr into every param group of ``optimizer``; return it."""
        lr = self.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore the number of updates done. The schedule's shape (lr, warm-up, decay)
        comes from the current configuration, so a resumed run may change it."""
        self.num_steps = int(state["num_steps"])

def _decay_coeff(style: str, ratio: float) -> float:
    """Fraction of (max_lr - min_lr) left after ``ratio`` in [0, 1] of the decay."""
    ratio = min(max(ratio, 0.0), 1.0)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":  # WSD cool-down: 1 at the start, 0 at the end
        return 2.0 * 0.5 ** ratio - 1.0
    raise ConfigError(f"unknown decay style {style!r}")
