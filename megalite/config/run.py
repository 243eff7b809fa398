"""Training-loop, checkpointing and logging settings."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import arg, check_choices, positive, require


# --exit-signal values: the signals a scheduler or a user sends before stopping a job
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
DEFAULT_SEED = 1234   # --seed (Megatron-LM's default); models, tools and the server use it too


@dataclass
class TrainConfig:
    micro_batch_size: int = arg(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = arg(None, "Samples per optimizer step "
                                           "(default micro_batch_size x dp).")
    train_iters: int | None = arg(None, "Optimizer steps to train for (or --train-samples).")
    train_samples: int | None = arg(None, "Samples to train for (sample-based training, "
                                    "excludes --train-iters); the run stops before a batch "
                                    "that would exceed it.")
    rampup_batch_size: list[int] | None = arg(
        None, "START INCREMENT RAMPUP_SAMPLES: the global batch grows from START to "
        "--global-batch-size in steps of INCREMENT, one step per RAMPUP_SAMPLES / "
        "((global - START) / INCREMENT) consumed samples (Megatron's ramp-up).", nargs="*")
    step_batch_size_schedule: str | None = arg(
        None, "\"THRESHOLD:BS THRESHOLD:BS ...\": the global batch is the BS of the last "
        "threshold reached; thresholds are consumed tokens (K/M/B/T suffixes), converted to "
        "samples by // --seq-length; the first must be 0, the last BS is the global batch.")
    calculate_per_token_loss: bool = arg(
        False, "Normalise the loss by the global number of loss tokens of the step (sum over "
        "micro-batches and data-parallel ranks), Megatron's per-token loss. megalite does this "
        "by default; the flag only rules out --per-microbatch-loss.")
    per_microbatch_loss: bool = arg(
        False, "Megatron's default normalisation instead of megalite's: each micro-batch's "
        "token mean, averaged over micro-batches and data-parallel ranks.")
    manual_gc: bool = arg(False, "Disable Python's automatic garbage collector; collect "
                          "every --manual-gc-interval iterations on all ranks together.")
    manual_gc_interval: int = arg(0, "Iterations between gc.collect() under --manual-gc "
                                  "(0: only around evaluations).")
    manual_gc_eval: bool = arg(True, "under --manual-gc, collecting before and after each "
                               "evaluation.", flag="--no-manual-gc-eval",
                               action="store_false")
    eval_iters: int = arg(100, "Batches per evaluation.")
    eval_interval: int = arg(1000, "Iterations between evaluations.")
    seed: int = arg(DEFAULT_SEED, "Random seed.")
    exit_interval: int | None = arg(None, "Exit at an iteration that is a multiple of this.")
    exit_duration_in_mins: float | None = arg(None, "Exit after this many minutes.")
    exit_signal_handler: bool = arg(False, "On --exit-signal (and on Ctrl-C's SIGINT), save a "
                                    "checkpoint and exit with 0.")
    exit_signal: str = arg("SIGTERM", "The signal --exit-signal-handler saves and exits on.",
                           choices=EXIT_SIGNALS)
    check_for_nan_in_loss_and_grad: bool = arg(True, "stopping on a NaN/inf loss or "
                                               "gradient.",
                                               flag="--no-check-for-nan-in-loss-and-grad",
                                               action="store_false")
    rerun_mode: str = arg("validate_results", "validate_results: re-run a step whose loss or "
                          "gradients are NaN/inf (or spiky, with --check-for-spiky-loss) once "
                          "from the same state, to tell a deterministic fault (stop, exit 5) "
                          "from a transient one (log the ranks, continue); disabled: stop at "
                          "the first NaN/inf.", choices=("disabled", "validate_results",
                                                         "report_stats"))
    check_for_spiky_loss: bool = arg(False, "Validate (re-run) a step whose loss exceeds "
                                     "--spiky-loss-factor x the mean of the last 10.")
    spiky_loss_factor: float = arg(10.0, "megalite-specific: the factor of "
                                   "--check-for-spiky-loss.")
    rerun_max_transient_faults: int = arg(3, "megalite-specific: stop (exit 6) after more than "
                                          "this many transient faults in one run.")
    error_injection_rate: int = arg(0, "Fault drill: inject a fault into the loss of the last "
                                    "rank at every N-th iteration (0: never).")
    error_injection_type: str = arg("transient_error", "What --error-injection-rate injects: "
                                    "a NaN in the first run of the step only (transient_error), "
                                    "in the re-run too (persistent_error), or nothing but a "
                                    "validation (correct_result).",
                                    choices=("correct_result", "transient_error",
                                             "persistent_error"))
    compile: bool = arg(False, "megalite-specific (Megatron has no such flag): "
                        "torch.compile each transformer layer (regional compilation: identical "
                        "layers share one graph; embedding, output layer and loss stay eager).")
    compile_mode: str | None = arg(None, "torch.compile mode under --compile (default: "
                                   "torch's default).",
                                   choices=(None, "default", "reduce-overhead", "max-autotune",
                                            "max-autotune-no-cudagraphs"))
    enable_experimental: bool = arg(
        False, "Megatron's switch for Megatron-Core's experimental features.",
        no_effect="megalite has no experimental mode: every feature it offers is on its own "
                  "flag")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "micro_batch_size", "global_batch_size", "train_iters", "train_samples",
                  "eval_interval", "exit_interval", "exit_duration_in_mins")
        require(self.eval_iters >= 0, "eval_iters must be >= 0")
        require(self.rerun_mode != "report_stats",
                "--rerun-mode report_stats is not supported; use validate_results (re-run "
                "suspicious steps) or disabled")
        require(self.spiky_loss_factor > 1.0,
                f"--spiky-loss-factor must be > 1, got {self.spiky_loss_factor}")
        require(self.error_injection_rate >= 0 and self.rerun_max_transient_faults >= 0,
                "--error-injection-rate and --rerun-max-transient-faults must be >= 0")
        require(self.error_injection_rate == 0 or self.rerun_mode == "validate_results",
                "--error-injection-rate needs --rerun-mode validate_results")
        require(self.compile_mode is None or self.compile,
                f"--compile-mode {self.compile_mode} needs --compile")
        require(self.manual_gc_interval >= 0,
                f"manual_gc_interval must be >= 0, got {self.manual_gc_interval}")
        require(not (self.calculate_per_token_loss and self.per_microbatch_loss),
                "--calculate-per-token-loss and --per-microbatch-loss select different loss "
                "normalisations; give one")
        if self.rampup_batch_size is not None:
            require(len(self.rampup_batch_size) == 3,
                    "--rampup-batch-size takes 3 values: START INCREMENT RAMPUP_SAMPLES; got "
                    f"{self.rampup_batch_size}")
            self.rampup_batch_size = [int(v) for v in self.rampup_batch_size]
            require(self.step_batch_size_schedule is None,
                    "give either --rampup-batch-size or --step-batch-size-schedule, not both")


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
    overwrite_checkpoints: bool = arg(
        False, "megalite-specific: a run that does not --load its --save directory may start "
        "there although it holds another run's checkpoints, which are deleted first "
        "(without this flag such a run stops before any work, naming them).")
    ckpt_verify: bool = arg(False, "Also record (at save) and check (at load) each file's "
                            "sha256, on top of the fast checksum always recorded.")
    no_ckpt_verify: bool = arg(False, "Do not check the files' fast checksums (xxh3_64 or "
                               "crc32) at load; sizes are still checked.")
    ckpt_step: int | None = arg(None, "Load this iteration of --load instead of the latest.")
    auto_detect_ckpt_format: bool = arg(
        False, "Megatron's switch to --load a checkpoint of any of its formats.",
        no_effect="megalite reads one format, its own, and recognises a Megatron-LM "
                  "checkpoint (torch_dist or per-rank) given to --load: it stops naming the "
                  "tools/convert_checkpoint.py command that converts it")
    dist_ckpt_optim_fully_reshardable: bool = arg(
        False, "Megatron's switch to save the distributed optimizer's state per "
        "parameter, so that it reshards on load.",
        no_effect="megalite saves the optimizer state per parameter always, and reshards it "
                  "on load at any layout and sharding strategy")
    dist_ckpt_strictness: str | None = arg(
        None, "What Megatron does with keys that the checkpoint and the model do not share.",
        choices=("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                 "raise_all", "return_unexpected", "return_all", "ignore_all"),
        no_effect="megalite's --load is always strict (Megatron's raise_all): a tensor the "
                  "model has that is missing or of another shape, or one it does not have, "
                  "stops the load with an error naming it")
    ckpt_format: str = arg("torch_dist", "Checkpoint format: torch_dist is megalite's "
                           "native format (torch.distributed.checkpoint with layout-free keys).",
                           choices=("torch_dist",))

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "save_interval")
        require(not (self.ckpt_verify and self.no_ckpt_verify),
                "--ckpt-verify (check sha256 too) and --no-ckpt-verify contradict each other")
        require(self.ckpt_step is None or self.ckpt_step >= 0,
                f"--ckpt-step must be >= 0, got {self.ckpt_step}")
        require(self.ckpt_step is None or self.load is not None,
                "--ckpt-step needs --load (the directory to take that iteration from)")


@dataclass
class LoggingConfig:
    log_interval: int = arg(100, "Iterations between log lines.")
    metrics_jsonl: str | None = arg(None, "Write one JSON object per iteration here.")
    tensorboard_dir: str | None = arg(None, "TensorBoard log directory.")
    tensorboard_log_interval: int = arg(1, "Iterations between TensorBoard (and wandb) "
                                        "scalars.")
    tensorboard_queue_size: int = arg(1000, "TensorBoard events held before a write to "
                                      "disk.")
    log_memory_to_tensorboard: bool = arg(
        False, "Add memory scalars to TensorBoard: on CUDA mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count (the caching "
        "allocator's, of the logging rank); on CPU mem-resident-bytes and "
        "mem-max-resident-bytes (the logging process's resident memory and its peak).")
    log_world_size_to_tensorboard: bool = arg(False, "Add the world-size scalar to "
                                              "TensorBoard.")
    log_batch_size_to_tensorboard: bool = arg(
        False, "Older Megatron-LM's switch for the batch-size scalar.",
        no_effect="the batch-size scalar (the global batch size of each iteration) is always "
                  "written, as Megatron-LM does today")
    wandb_project: str | None = arg(None, "Weights & Biases project.")
    wandb_exp_name: str | None = arg(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = arg(None, "Weights & Biases local directory.")
    timing_log_level: int = arg(0, "0: iteration time only; 1: + forward/backward/"
                                "optimizer; 2: + communication.", choices=(0, 1, 2))
    logging_level: int | None = arg(None, "Level of Python's logging for megalite's "
                                    "loggers (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR).")
    log_params_norm: bool = arg(False, "Add the L2 norm of all parameters (each element "
                                "counted once, whatever the layout) to the log line, "
                                "TensorBoard (params-norm) and the JSONL (params_norm).")
    log_num_zeros_in_grad: bool = arg(False, "Add the number of gradient elements that are "
                                      "zero (each counted once, whatever the layout) to the "
                                      "log line, TensorBoard (num-zeros) and the JSONL "
                                      "(num_zeros).")
    log_timers_to_tensorboard: bool = arg(False, "Add the timers of --timing-log-level to "
                                          "TensorBoard (<name>-time, ms per iteration).")
    log_validation_ppl_to_tensorboard: bool = arg(False, "Add the validation perplexity to "
                                                  "TensorBoard (lm loss validation ppl).")
    log_throughput: bool = arg(False, "Add Megatron's 'throughput per GPU (TFLOP/s/GPU)' "
                               "(model FLOPs per second per rank) to the log line.")
    no_log_throughput: bool = arg(False, "Turns --log-throughput off (over a --config file "
                                  "that sets it).")
    profile: bool = arg(False, "Record a torch.profiler trace of iterations "
                        "--profile-step-start+1 .. --profile-step-end on --profile-ranks, "
                        "written to --tensorboard-dir (else SAVE/profile, else ./profile).")
    use_pytorch_profiler: bool = arg(False, "Use torch.profiler for --profile (the only "
                                     "profiler here; accepted for Megatron scripts).")
    profile_step_start: int = arg(10, "Iterations done when profiling starts.")
    profile_step_end: int = arg(12, "Iterations done when profiling stops.")
    profile_ranks: list[int] = arg([0], "Global ranks to profile.", nargs="+")
    pytorch_profiler_collect_shapes: bool = arg(
        False, "--profile: record the operators' input shapes (torch.profiler's "
        "record_shapes; off by default, as in Megatron-LM).")
    pytorch_profiler_collect_callstack: bool = arg(
        False, "--profile: record Python call stacks (torch.profiler's with_stack).")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "log_interval")
        positive(self, "tensorboard_log_interval")
        positive(self, "tensorboard_queue_size")
        if self.no_log_throughput:
            self.log_throughput = False
        require(0 <= self.profile_step_start < self.profile_step_end,
                f"--profile-step-start ({self.profile_step_start}) must be >= 0 and below "
                f"--profile-step-end ({self.profile_step_end})")
        self.profile_ranks = [int(r) for r in self.profile_ranks]
