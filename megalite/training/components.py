"""What a training run holds while it runs: its progress and the pieces it drives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from megalite.checkpoint.lock import SaveLock
from megalite.config import ConfigError, MegaliteConfig
from megalite.config.batch_schedule import BatchSchedule
from megalite.config.layout import ResolvedLayout
from megalite.data.tokenizers import Tokenizer
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.lr_schedule import LRScheduler
from megalite.optim.optimizer import LossScaledOptimizer
from megalite.parallel.random import RNGTracker
from megalite.parallel.state import ParallelState
from megalite.training.metrics import MetricsLogger
from megalite.training.timers import Timers


WANDB_RUN_ID = "wandb_run_id"   # the metadata.json key of the run's wandb id


@dataclass
class TrainState:
    """Progress that a checkpoint restores."""

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iters: int = 0


@dataclass
class TrainingComponents:
    """The pieces :func:`megalite.training.loop.train` drives, as built by
    :func:`megalite.training.build.build_components`."""

    cfg: MegaliteConfig
    ps: ParallelState
    model: torch.nn.Module
    grads: DataParallelGrads
    optimizer: LossScaledOptimizer     # MixedPrecisionOptimizer or DistributedOptimizer
    scheduler: LRScheduler
    timers: Timers
    metrics: MetricsLogger
    train_dataset: Dataset
    valid_dataset: Dataset | None
    layout: ResolvedLayout                     # the run's resolved layout, vocabulary known
    peak_flops: float
    state: TrainState = field(default_factory=TrainState)
    rng_tracker: RNGTracker | None = None
    tokenizer: Tokenizer | None = None
    start_time: float = field(default_factory=time.time)  # wall clock when building began
    save_lock: SaveLock | None = None  # rank 0 of a job with --save holds SAVE/.megalite.lock
    test_dataset: Dataset | None = None   # the --split test part, evaluated at the end
    wandb_id: str | None = None   # with --wandb-project: the run id the checkpoints carry

    def checkpoint_meta(self) -> dict:
        """Keys this run adds to each checkpoint's metadata.json (the wandb run id)."""
        return {WANDB_RUN_ID: self.wandb_id} if self.wandb_id else {}

    @property
    def schedule(self) -> BatchSchedule:
        """The global batch size per consumed samples (``megalite.config.batch_schedule``)."""
        return self.layout.batch_schedule

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step of a final-size global batch (and of evaluation)."""
        return self.layout.num_microbatches

    @property
    def flops_per_iteration(self) -> float:
        """Model FLOPs of a final-size global batch."""
        return self.layout.model_flops_per_step

    def _loader(self, dataset, consumed_samples: int):
        from megalite.data.samplers import build_data_loader

        t = self.cfg.train
        with torch.random.fork_rng(devices=[]):
            return iter(build_data_loader(dataset, consumed_samples, t.micro_batch_size,
                                          self.ps.dp.rank, self.ps.dp.size,
                                          self.cfg.data.num_workers, self.ps.device))

    def train_iterator(self, consumed_samples: int) -> Iterator:
        """This rank's training micro-batches, resuming after ``consumed_samples``: one
        stream in which every ``micro_batch_size x dp`` samples are one micro-batch per dp
        rank, so a step of ``n`` micro-batches per rank consumes exactly ``n x micro x dp``
        samples, whatever the batch size of the step."""
        return self._loader(self.train_dataset, consumed_samples)

    def valid_iterator(self, iteration: int) -> Iterator | None:
        """Validation micro-batches, cycling, positioned as after ``iteration`` training
        iterations (Megatron's ``consumed_valid_samples``)."""
        if self.valid_dataset is None:
            return None
        t = self.cfg.train
        total = len(self.valid_dataset)
        consumed = (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size
        return _cycle(lambda start: self._loader(self.valid_dataset, start),
                      consumed % total if total else 0)

    def test_iterator(self) -> Iterator | None:
        """Test micro-batches from the start of the test set, cycling (the end-of-training
        evaluation reads ``--eval-iters`` batches of it)."""
        if self.test_dataset is None:
            return None
        return _cycle(lambda start: self._loader(self.test_dataset, start), 0, "test")

    def close(self) -> None:
        self.metrics.close()
        self.grads.remove_hooks()
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None


def _cycle(make: Callable[[int], Iterator], start: int, name: str = "validation") -> Iterator:
    """Items of ``make(start)``, then of ``make(0)`` over and over."""
    iterator = make(start)
    while True:
        empty = True
        for item in iterator:
            empty = False
            yield item
        if empty and start == 0:
            raise ConfigError(f"the {name} set holds less than one micro-batch per "
                              "data-parallel rank; lower --micro-batch-size or change --split")
        iterator, start = make(0), 0
