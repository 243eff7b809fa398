"""The global batch size as a function of the samples consumed so far.

Three sources, one rule (Megatron-Core's micro-batch calculators):

- constant: ``--global-batch-size``;
- ``--step-batch-size-schedule "T0:B0 T1:B1 ..."``: the global batch is the ``B`` of the
  last threshold ``T`` reached (``consumed >= T``). Thresholds are consumed *tokens* with
  optional K/M/B/T suffixes (1e3 .. 1e12), turned into samples by ``// seq_length``; the
  first must be 0, they must increase, and the last ``B`` is the final global batch size.
  ``"0:16 2.4B:320"`` with seq_length 2048 switches to 320 once 1,171,875 samples are used;
- ``--rampup-batch-size START INCREMENT RAMPUP_SAMPLES``: the batch goes from START to
  ``--global-batch-size`` in ``n = (global - START) / INCREMENT`` steps, the k-th step
  after ``k * RAMPUP_SAMPLES / n`` consumed samples (so ``START + floor(consumed * n /
  RAMPUP_SAMPLES) * INCREMENT`` until RAMPUP_SAMPLES, then the global batch). It is kept
  as a schedule with thresholds ``ceil(k * RAMPUP_SAMPLES / n)`` (exact integer arithmetic).

The number of micro-batches of a step is ``global_batch_size(consumed) / (micro x dp)``;
every batch size of the schedule must divide by ``micro x dp`` (checked by
:meth:`check_divisible`, from ``MegaliteConfig.validate``). Since a step consumes exactly
its global batch from the sampler's stream (``megalite.data.samplers``), the data of every
step is a function of the consumed samples alone: a resumed run, or one with another dp
size, reads the same samples in the same steps.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from megalite.config.fields import ConfigError

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_count(text: str) -> int:
    """``"2.4B"`` -> 2400000000 (suffixes K, M, B, T; case-insensitive)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ConfigError(f"--step-batch-size-schedule: {text!r} is not a number "
                          "(optionally with a K/M/B/T suffix)") from None


def parse_step_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2.4e9 // seq_length, 320)]`` (thresholds in
    samples). Entries may be separated by spaces or commas."""
    entries = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ConfigError(f"--step-batch-size-schedule entry {entry!r} is not "
                              "THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        entries.append((parse_count(threshold) // seq_length, parse_count(batch)))
    if not entries:
        raise ConfigError("--step-batch-size-schedule is empty")
    if entries[0][0] != 0:
        raise ConfigError(f"--step-batch-size-schedule must start at threshold 0; its first "
                          f"entry starts at {entries[0][0]} samples")
    for (t0, _), (t1, _) in zip(entries, entries[1:]):
        if t1 <= t0:
            raise ConfigError(f"--step-batch-size-schedule thresholds must increase (in "
                              f"samples of seq_length {seq_length}): {t0} then {t1}")
    for _, batch in entries:
        if batch <= 0:
            raise ConfigError(f"--step-batch-size-schedule batch sizes must be positive, "
                              f"got {batch}")
    return entries


def rampup_schedule(start: int, increment: int, rampup_samples: int,
                    global_batch_size: int) -> list[tuple[int, int]]:
    """Megatron's ramp-up as ``[(threshold_samples, batch_size), ...]`` (see module doc)."""
    if start <= 0 or increment <= 0 or rampup_samples < 0:
        raise ConfigError(f"--rampup-batch-size {start} {increment} {rampup_samples}: START "
                          "and INCREMENT must be positive, RAMPUP_SAMPLES >= 0")
    diff = global_batch_size - start
    if diff < 0 or diff % increment:
        raise ConfigError(f"--rampup-batch-size: global_batch_size ({global_batch_size}) - "
                          f"START ({start}) must be a non-negative multiple of INCREMENT "
                          f"({increment})")
    steps = diff // increment
    if steps == 0:
        return [(0, start)]
    return [(-(-k * rampup_samples // steps), start + k * increment)
            for k in range(steps + 1)]


@dataclass(frozen=True)
class BatchSchedule:
    """``entries``: ``[(threshold_samples, global_batch_size), ...]``, thresholds rising
    from 0. A single entry is a constant batch size."""

    entries: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, global_batch_size: int) -> BatchSchedule:
        return cls(((0, global_batch_size),))

    @classmethod
    def from_config(cls, train_cfg, seq_length: int) -> BatchSchedule:
        """From ``TrainConfig`` (its ``global_batch_size`` already resolved)."""
        t = train_cfg
        if t.step_batch_size_schedule:
            return cls(tuple(parse_step_schedule(t.step_batch_size_schedule, seq_length)))
        if t.rampup_batch_size:
            start, inc, samples = (int(v) for v in t.rampup_batch_size)
            return cls(tuple(rampup_schedule(start, inc, samples, t.global_batch_size)))
        return cls.constant(t.global_batch_size)

    @property
    def variable(self) -> bool:
        """True when the batch size changes during training."""
        return len({b for _, b in self.entries}) > 1

    @property
    def final_batch_size(self) -> int:
        return self.entries[-1][1]

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples``."""
        thresholds = [t for t, _ in self.entries]
        return self.entries[bisect.bisect_right(thresholds, consumed_samples) - 1][1]

    def num_microbatches(self, consumed_samples: int, micro_batch_size: int,
                         data_parallel_size: int) -> int:
        return self.global_batch_size(consumed_samples) // (micro_batch_size
                                                             * data_parallel_size)

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` steps."""
        consumed = done = 0
        while done < iterations:
            if consumed >= self.entries[-1][0]:  # constant from here on
                return consumed + (iterations - done) * self.final_batch_size
            consumed += self.global_batch_size(consumed)
            done += 1
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Steps of a ``--train-samples`` run: full batches while they fit in the budget
        (a final partial batch is dropped, as Megatron does)."""
        iterations = consumed = 0
        while True:
            batch = self.global_batch_size(consumed)
            if consumed + batch > train_samples:
                return iterations
            if consumed >= self.entries[-1][0]:  # constant from here on
                return iterations + (train_samples - consumed) // batch
            consumed += batch
            iterations += 1

    def check_divisible(self, micro_batch_size: int, data_parallel_size: int,
                        pipeline_size: int | None = None) -> None:
        """Every batch size divides by ``micro x dp`` (and, for the interleaved pipeline
        schedule -- ``pipeline_size`` given -- gives a number of micro-batches that divides
        by it: :func:`check_interleaved`)."""
        unit = micro_batch_size * data_parallel_size
        for threshold, batch in self.entries:
            constant = len(self.entries) == 1
            if batch % unit:
                name = (f"global_batch_size ({batch}) must be" if constant else f"batch-size "
                        f"schedule entry {batch} (from {threshold} consumed samples) is not")
                raise ConfigError(f"{name} divisible by micro_batch_size "
                                  f"({micro_batch_size}) x data parallel size "
                                  f"({data_parallel_size})")
            source = (f"global_batch_size {batch}" if constant else
                      f"batch-size schedule entry {batch} from {threshold} consumed samples")
            if pipeline_size:
                check_interleaved(batch // unit, pipeline_size,
                                  f" = {source} / (micro_batch_size {micro_batch_size} x "
                                  f"data parallel {data_parallel_size})")


def check_interleaved(num_microbatches: int, pipeline_size: int, how: str = "") -> None:
    """The interleaved pipeline schedule runs the micro-batches of a step in groups of
    ``pipeline_size``: their number must be a multiple of it (``how``: how the number was
    derived, for the message)."""
    if num_microbatches % pipeline_size:
        raise ConfigError(f"the interleaved pipeline schedule needs the number of "
                          f"micro-batches ({num_microbatches}{how}) to be a multiple of "
                          f"pipeline_model_parallel_size ({pipeline_size}); change "
                          "--global-batch-size or --micro-batch-size")
