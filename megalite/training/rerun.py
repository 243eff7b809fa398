"""Faults told from bugs: re-run a suspicious step once from the same state.

Megatron's ``--rerun-mode validate_results``: when a step's loss is NaN/inf, or (with
``--check-for-spiky-loss``) more than ``--spiky-loss-factor`` times the mean of the last
``SPIKE_WINDOW`` accepted losses, or its gradients hold NaN/inf, the step's forward and
backward run again on the same micro-batches from the same RNG state (the parameters have
not changed: the check comes before the optimizer's update).

- The re-run reproduces the result bit for bit: the fault is deterministic (the data or the
  model). Training stops with :class:`DeterministicFaultError` (exit code 5, a numerical
  error: restarting will not help) naming the iteration, the reason and the samples of the
  global batch.
- The re-run differs: a transient fault (hardware). Each rank's share of the loss is
  compared between the two runs, so the log names the ranks whose result changed; the step
  continues with the re-run's result. More than ``--rerun-max-transient-faults`` in one run
  stop it with :class:`TransientFaultError` (exit code 6: restart, excluding those nodes).

Whether a step is suspicious is agreed by all ranks (one scalar all-reduce per step); a
validation costs one extra forward and backward, only on suspicious steps.

Fault injection for tests and drills (Megatron's flags): ``--error-injection-rate N``
corrupts the loss of the last rank at every N-th iteration; ``--error-injection-type``
``transient_error`` corrupts the first computation only, ``persistent_error`` both, and
``correct_result`` corrupts nothing but validates the step anyway (the re-run must then
reproduce it exactly).
"""

from __future__ import annotations

import math
import struct
from collections import deque
from dataclasses import dataclass, field

import torch

from megalite.errors import EXIT_TRANSIENT_FAULT, NumericalError
from megalite.parallel.collectives import ReduceOp, all_gather_object, all_reduce_scalar

SPIKE_WINDOW = 10
REQUESTED = "a validation requested by --error-injection-type correct_result"


class DeterministicFaultError(NumericalError):
    """A suspicious step whose re-run reproduced it exactly: the data or the model
    (exit code 5, like every numerical error: restarting will not help)."""


class TransientFaultError(NumericalError):
    """Too many steps whose re-run differed: suspect the hardware of the named ranks."""

    exit_code = EXIT_TRANSIENT_FAULT


@dataclass
class Snapshot:
    """What a step's forward/backward consumes besides parameters and batches."""

    cpu_rng: torch.Tensor
    device_rng: torch.Tensor | None
    streams: dict | None


@dataclass
class ResultValidator:
    """Decides which steps to re-run and judges the re-run (see module doc).

    ``mode``: ``disabled`` or ``validate_results``; ``spiky_factor``: None (no spike check)
    or the factor of the recent mean; ``injection``: (rate, type) or None."""

    mode: str = "disabled"
    spiky_factor: float | None = None
    max_transient: int = 3
    injection_rate: int = 0
    injection_type: str = "transient_error"
    recent: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    transient_faults: list = field(default_factory=list)   # (iteration, ranks)

    @classmethod
    def from_config(cls, t) -> ResultValidator:
        return cls(mode=t.rerun_mode,
                   spiky_factor=t.spiky_loss_factor if t.check_for_spiky_loss else None,
                   max_transient=t.rerun_max_transient_faults,
                   injection_rate=t.error_injection_rate,
                   injection_type=t.error_injection_type)

    @property
    def enabled(self) -> bool:
        return self.mode == "validate_results"

    # -- what is suspicious ---------------------------------------------------------------
    def injects(self, iteration: int) -> bool:
        return self.injection_rate > 0 and iteration % self.injection_rate == 0

    def corrupt(self, loss_sum: torch.Tensor, iteration: int, attempt: int, ps) -> torch.Tensor:
        """``loss_sum`` with the injected fault of this attempt (0: first run, 1: re-run)
        on the last rank of the world; unchanged elsewhere."""
        if not self.injects(iteration) or ps.rank != ps.world_size - 1:
            return loss_sum
        bad = (self.injection_type == "persistent_error"
               or (self.injection_type == "transient_error" and attempt == 0))
        return loss_sum * float("nan") if bad else loss_sum

    def decide(self, lm_loss: float, iteration: int, ps) -> str | None:
        """:meth:`suspicious`, agreed by every rank of the world (one fp64 all-reduce, MAX):
        a NaN seen only by some data-parallel groups still re-runs the step everywhere."""
        reason = self.suspicious(lm_loss, iteration)
        anyone = all_reduce_scalar(0.0 if reason is None else 1.0, None, ReduceOp.MAX,
                                   ps.device)
        if anyone and reason is None:
            reason = "a NaN/inf or spiky loss on another rank"
        return reason

    def suspicious(self, lm_loss: float, iteration: int, found_inf: bool = False) -> str | None:
        """Why the step needs a re-run (None: it does not), from this rank's view."""
        if not self.enabled:
            return None
        if found_inf:
            return "the gradients hold NaN/inf"
        if not math.isfinite(lm_loss):
            return f"the loss is {lm_loss}"
        if self.spiky_factor is not None and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if lm_loss > self.spiky_factor * mean:
                return (f"the loss {lm_loss:.6g} is over {self.spiky_factor:g}x the mean of "
                        f"the last {len(self.recent)} ({mean:.6g}; --spiky-loss-factor)")
        if self.injects(iteration) and self.injection_type == "correct_result":
            return REQUESTED
        return None

    def accept(self, lm_loss: float) -> None:
        """Record a step's loss for the spike check's window."""
        if math.isfinite(lm_loss):
            self.recent.append(lm_loss)

    # -- the re-run -----------------------------------------------------------------------
    @staticmethod
    def snapshot(c) -> Snapshot:
        device = c.ps.device
        return Snapshot(
            cpu_rng=torch.get_rng_state(),
            device_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            streams=c.rng_tracker.get_states() if c.rng_tracker is not None else None)

    @staticmethod
    def restore(c, snap: Snapshot) -> None:
        torch.set_rng_state(snap.cpu_rng)
        if snap.device_rng is not None:
            torch.cuda.set_rng_state(snap.device_rng, c.ps.device)
        if snap.streams is not None:
            c.rng_tracker.set_states(snap.streams)

    def judge(self, reason: str, iteration: int, first: torch.Tensor, second: torch.Tensor,
              ps, samples: tuple[int, int],
              reproduced: bool | None = None) -> list[int] | None:
        """Compare the two runs of a step: ``first``/``second`` are this rank's local loss
        sums, gathered over the world (a collective of every rank). ``reproduced`` says
        whether the fault came back (default: every rank's sum is bit-identical).

        A reproduced fault raises :class:`DeterministicFaultError` (a requested validation
        that reproduces returns None: the step is valid). Otherwise the step had a
        transient fault: returns the ranks whose result changed, raising
        :class:`TransientFaultError` past ``max_transient`` such steps in this run."""
        a = all_gather_object(_bits(first))    # one entry per rank of the world
        b = all_gather_object(_bits(second))
        changed = [r for r, (x, y) in enumerate(zip(a, b)) if x != y]
        reproduced = reproduced if reproduced is not None else not changed
        if reason == REQUESTED and reproduced:   # nothing was wrong: the step is valid
            return None
        if reproduced:
            raise DeterministicFaultError(
                f"iteration {iteration}: {reason}, and re-running the step from the same "
                f"state reproduced it, so it is deterministic (the data or the model, not "
                f"the hardware): global batch samples {samples[0]}..{samples[1] - 1} of the "
                f"training data; inspect those samples, or lower the learning rate")
        self.transient_faults.append((iteration, changed))
        if len(self.transient_faults) > self.max_transient:
            raise TransientFaultError(
                f"iteration {iteration}: {len(self.transient_faults)} transient faults in this "
                f"run (over --rerun-max-transient-faults {self.max_transient}); ranks whose "
                f"results changed on re-run: "
                f"{sorted({r for _, rs in self.transient_faults for r in rs})}; "
                f"restart the job without their nodes")
        return changed


def _bits(t: torch.Tensor) -> bytes:
    """The bytes of a float64 row: equal only when bit-identical (NaN included)."""
    return struct.pack(f"{t.numel()}d", *t.double().flatten().tolist())
