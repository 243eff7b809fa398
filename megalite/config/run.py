"""Training-loop, checkpointing and logging settings."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import arg, check_choices, positive, require


@dataclass
class TrainConfig:
    micro_batch_size: int = arg(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = arg(None, "Samples per optimizer step "
                                           "(default micro_batch_size x dp).")
    train_iters: int | None = arg(None, "Optimizer steps to train for.")
    eval_iters: int = arg(100, "Batches per evaluation.")
    eval_interval: int = arg(1000, "Iterations between evaluations.")
    seed: int = arg(1234, "Random seed.")
    exit_interval: int | None = arg(None, "Exit at an iteration that is a multiple of this.")
    exit_duration_in_mins: float | None = arg(None, "Exit after this many minutes.")
    exit_signal_handler: bool = arg(False, "On SIGTERM, save a checkpoint and exit.")
    check_for_nan_in_loss_and_grad: bool = arg(True, "Stop on a NaN/inf loss or gradient.",
                                               flag="--no-check-for-nan-in-loss-and-grad",
                                               action="store_false")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "micro_batch_size", "global_batch_size", "train_iters",
                  "eval_interval", "exit_interval", "exit_duration_in_mins")
        require(self.eval_iters >= 0, "eval_iters must be >= 0")


@dataclass
class CheckpointConfig:
    save: str | None = arg(None, "Directory to save checkpoints to.")
    load: str | None = arg(None, "Directory to load a checkpoint from.")
    save_interval: int | None = arg(None, "Iterations between checkpoints.")
    no_save_optim: bool = arg(False, "Do not save the optimizer state.")
    no_save_rng: bool = arg(False, "Do not save the RNG states.")
    no_load_optim: bool = arg(False, "Do not load the optimizer state.")
    no_load_rng: bool = arg(False, "Do not load the RNG states.")
    finetune: bool = arg(False, "Load weights only and start at iteration 0.")
    async_save: bool = arg(False, "Write checkpoints in a background thread.")
    ckpt_verify: bool = arg(False, "Record and check file checksums.")
    ckpt_format: str = arg("torch_dist", "Checkpoint format: torch_dist is megalite's "
                           "native format (torch.distributed.checkpoint with layout-free keys).",
                           choices=("torch_dist",))

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "save_interval")


@dataclass
class LoggingConfig:
    log_interval: int = arg(100, "Iterations between log lines.")
    metrics_jsonl: str | None = arg(None, "Write one JSON object per iteration here.")
    tensorboard_dir: str | None = arg(None, "TensorBoard log directory.")
    wandb_project: str | None = arg(None, "Weights & Biases project.")
    wandb_exp_name: str | None = arg(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = arg(None, "Weights & Biases local directory.")
    timing_log_level: int = arg(0, "0: iteration time only; 1: + forward/backward/"
                                "optimizer; 2: + communication.", choices=(0, 1, 2))
    log_throughput: bool = arg(True, "Report tokens/s and MFU.")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "log_interval")
