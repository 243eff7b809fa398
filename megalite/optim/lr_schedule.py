"""Learning-rate schedules: linear warm-up, then constant / linear / cosine / inverse square
root / WSD (warmup-stable-decay) decay down to ``min_lr``.

Steps count optimizer updates that succeeded (a skipped fp16 step does not advance the
schedule). The learning rate used by update ``k`` (0-based) is ``lr_at(k)``: with warm-up
the first update runs at ``--lr-warmup-init`` (default 0) and the warm-up rises linearly
from there to the peak, as in Megatron-LM.

Units (``unit``): ``"iterations"`` (the default: ``--train-iters`` with a constant batch),
or ``"samples"``, Megatron's unit, used for sample-based training (``--train-samples``,
``--lr-*-samples``) and for batch-size schedules: the schedule then advances by the
samples of each update (:meth:`advance`) and iteration-based lengths are converted with
the final global batch size (``--lr-decay-iters 100`` is 100 x global_batch_size samples).
With a constant batch both units give the same curve.

``--decoupled-lr`` / ``--decoupled-min-lr``: parameter groups marked ``decoupled_lr``
(the input embedding and output layer, see ``megalite.optim.optimizer.param_groups``)
follow the same schedule shape with their own peak and minimum.

    sched = LRScheduler.from_config(cfg.optim, train_iters=cfg.train.train_iters)
    sched.apply(optimizer)       # write lr_at(num_steps) into every param group
    optimizer.step(); sched.advance(samples_of_this_step)
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
    unit: str = "iterations"
    decoupled_max_lr: float | None = None
    decoupled_min_lr: float | None = None
    warmup_init_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(f"unknown --lr-decay-style {self.decay_style!r}; "
                              f"choose from {DECAY_STYLES}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"unknown --lr-wsd-decay-style {self.wsd_decay_style!r}")
        if self.decay_style not in ("constant", "inverse-square-root") \
                and self.decay_steps < self.warmup_steps:
            raise ConfigError(f"lr decay {self.unit} ({self.decay_steps}) must not be fewer "
                              f"than the warm-up {self.unit} ({self.warmup_steps})")
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or "
                                  "--lr-wsd-decay-samples)")
            if self.wsd_decay_steps > self.decay_steps - self.warmup_steps:
                raise ConfigError(f"the WSD cool-down ({self.wsd_decay_steps} {self.unit}) "
                                  f"must not exceed decay - warm-up "
                                  f"({self.decay_steps - self.warmup_steps})")

    @classmethod
    def from_config(cls, ocfg: OptimConfig, train_iters: int | None, *,
                    train_samples: int | None = None,
                    global_batch_size: int | None = None) -> LRScheduler:
        """Resolve defaults: decay over ``train_iters`` unless ``--lr-decay-iters`` is given;
        ``--lr-warmup-fraction`` is a fraction of the decay iterations.

        With ``global_batch_size`` (the final one) the schedule counts samples (see the
        module docstring): ``--lr-*-samples`` as given, ``--lr-*-iters`` times the batch,
        decay by default over ``train_samples`` (or ``train_iters`` x batch)."""
        common = dict(decoupled_max_lr=ocfg.decoupled_lr,
                      decoupled_min_lr=(ocfg.min_lr if ocfg.decoupled_min_lr is None
                                        else ocfg.decoupled_min_lr)
                      if ocfg.decoupled_lr is not None else None,
                      warmup_init_lr=ocfg.lr_warmup_init)
        if global_batch_size is not None:
            return cls._in_samples(ocfg, train_iters, train_samples, global_batch_size,
                                   common)
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
                   wsd_decay_steps=ocfg.lr_wsd_decay_iters, **common)

    @classmethod
    def for_run(cls, cfg, schedule) -> LRScheduler:
        """The schedule of the run ``cfg`` (a MegaliteConfig) whose global batches follow
        ``schedule`` (the resolved layout's BatchSchedule): it counts samples under
        ``--train-samples`` or a batch size that changes, iterations otherwise."""
        t = cfg.train
        samples_based = t.train_samples is not None or schedule.variable
        return cls.from_config(cfg.optim, t.train_iters, train_samples=t.train_samples,
                               global_batch_size=t.global_batch_size if samples_based
                               else None)

    @classmethod
    def _in_samples(cls, ocfg: OptimConfig, train_iters: int | None,
                    train_samples: int | None, gbs: int, common: dict) -> LRScheduler:
        def samples(n_samples: int | None, n_iters: int | None) -> int | None:
            return n_samples if n_samples else (n_iters * gbs if n_iters else None)

        decay = samples(ocfg.lr_decay_samples, ocfg.lr_decay_iters)
        decay = decay or train_samples or (train_iters * gbs if train_iters else None)
        warmup = samples(ocfg.lr_warmup_samples, ocfg.lr_warmup_iters) or 0
        if decay is None:
            if ocfg.lr_decay_style != "constant":
                raise ConfigError("the lr schedule needs --lr-decay-samples, --train-samples "
                                  "or --train-iters")
            decay = max(warmup, 1)
        if ocfg.lr_warmup_fraction is not None:
            warmup = int(ocfg.lr_warmup_fraction * decay)
        return cls(max_lr=ocfg.lr, min_lr=ocfg.min_lr, warmup_steps=warmup, decay_steps=decay,
                   decay_style=ocfg.lr_decay_style, wsd_decay_style=ocfg.lr_wsd_decay_style,
                   wsd_decay_steps=samples(ocfg.lr_wsd_decay_samples,
                                           ocfg.lr_wsd_decay_iters),
                   unit="samples", **common)

    # -- the schedule -------------------------------------------------------------------
    def lr_at(self, step: int, decoupled: bool = False) -> float:
        """Learning rate of update number ``step`` (0-based, in ``unit``); ``decoupled``:
        that of the ``--decoupled-lr`` groups."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if decoupled and self.decoupled_max_lr is not None:
            max_lr, min_lr = self.decoupled_max_lr, self.decoupled_min_lr
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            init = self.warmup_init_lr
            return init + (max_lr - init) * step / self.warmup_steps
        if self.decay_style == "constant":
            return max_lr
        if self.decay_style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        if step > self.decay_steps:
            return min_lr
        span = max_lr - min_lr
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                return max_lr
            return min_lr + span * _decay_coeff(
                self.wsd_decay_style, (step - anneal_start) / self.wsd_decay_steps)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return min_lr + span * _decay_coeff(self.decay_style, ratio)

    @property
    def lr(self) -> float:
        """Learning rate of the next update."""
        return self.lr_at(self.num_steps)

    def apply(self, optimizer) -> float:
        """Write the next update's lr into every param group of ``optimizer`` (groups with
        ``decoupled_lr`` get the decoupled schedule); return the main lr."""
        lr = self.lr
        decoupled = self.lr_at(self.num_steps, decoupled=True)
        for group in optimizer.param_groups:
            group["lr"] = decoupled if group.get("decoupled_lr") else lr
        return lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment

    def advance(self, samples: int) -> None:
        """After a successful update of ``samples`` samples: +1 iteration, or +samples."""
        self.step(samples if self.unit == "samples" else 1)

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore the number of updates done. The schedule's shape (lr, warm-up, decay)
        comes from the current configuration, so a resumed run may change it."""
        unit = state.get("unit", "iterations")
        if unit != self.unit:
            raise ConfigError(f"the checkpoint's lr schedule counts {unit} but this run's "
                              f"counts {self.unit} (sample-based training or a batch-size "
                              "schedule count samples); resume with the same kind of "
                              "schedule")
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
