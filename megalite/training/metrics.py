"""Where training metrics go: the Megatron-style human line, a JSONL file, TensorBoard and
Weights & Biases.

Only the logging rank (the last rank, which holds the loss under pipeline parallelism)
writes; every other rank constructs a disabled :class:`MetricsLogger`. TensorBoard and
wandb are imported lazily, only when their flags are set (wandb honours
``WANDB_MODE=offline``).

JSONL contract (one object per iteration; docs/training.md lists the fields)::

    {"iteration": 12, "lm_loss": 7.91, "grad_norm": 1.3, "lr": 0.0003, "loss_scale": 1.0,
     "skipped": false, "tokens_per_sec": 5120.0, "mfu": 0.021}

``grad_norm`` is null on a skipped iteration. An iteration that ran an evaluation also
carries ``validation_loss`` and ``validation_ppl``; an MoE model's iterations carry
``moe_aux_loss`` / ``moe_z_loss`` (means over MoE layers and the global batch), which
also reach the human line (averaged over the log window), TensorBoard and wandb. Under a
batch-size schedule (``--rampup-batch-size``, ``--step-batch-size-schedule``) every
iteration carries its ``global_batch_size``. ``--log-max-attention-logit`` (or
``--qk-clip``) adds ``max_attention_logit``, the step's largest attention logit (line,
JSONL, and TensorBoard / wandb under Megatron-LM's name ``max_attention_logit``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

from megalite.checkpoint.files import write_text_atomic
from megalite.config import LoggingConfig


@dataclass
class IterationMetrics:
    """One training iteration, as every sink sees it."""

    iteration: int
    lm_loss: float
    grad_norm: float | None
    lr: float
    loss_scale: float
    skipped: bool
    tokens_per_sec: float
    mfu: float
    elapsed_s: float = 0.0
    consumed_samples: int = 0
    global_batch_size: int = 0
    tflops_per_gpu: float = 0.0   # model TFLOP/s per rank (the line's, --log-throughput)
    num_zeros: int | None = None       # --log-num-zeros-in-grad
    params_norm: float | None = None   # --log-params-norm
    max_attention_logit: float | None = None   # --log-max-attention-logit, --qk-clip

    def jsonl(self) -> dict:
        keys = ("iteration", "lm_loss", "grad_norm", "lr", "loss_scale", "skipped",
                "tokens_per_sec", "mfu")
        full = asdict(self)
        row = {k: full[k] for k in keys}
        row.update({k: full[k] for k in ("num_zeros", "params_norm", "max_attention_logit")
                    if full[k] is not None})
        return row


@dataclass
class _Window:
    """Accumulates iterations between two human log lines."""

    iters: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0
    tokens_per_sec: float = 0.0
    mfu: float = 0.0
    tflops_per_gpu: float = 0.0
    moe_sums: dict = field(default_factory=dict)  # moe_* key -> sum over the window


def arguments_block(config: dict, title: str = "arguments") -> str:
    """Megatron's start-up dump of its arguments: a ``---- arguments ----`` rule, one
    ``  name ..... value`` line per setting of every section of ``config`` (a
    ``MegaliteConfig.to_dict()``), sorted by name, and an ``end of arguments`` rule."""
    settings = {name: value for section in config.values() for name, value in section.items()}
    lines = [f"  {name} {'.' * max(48 - len(name), 3)} {settings[name]}"
             for name in sorted(settings, key=str.lower)]
    return "\n".join([f"------------------------ {title} ------------------------", *lines,
                      f"-------------------- end of {title} ---------------------"])


def _moe_values(extra: dict | None) -> dict:
    """The MoE router losses (``moe_*`` keys) among the extra JSONL fields."""
    return {k: v for k, v in (extra or {}).items() if k.startswith("moe_")}


class MetricsLogger:
    """Sends :class:`IterationMetrics` to stdout, JSONL, TensorBoard and wandb.

    ``enabled`` False (non-logging ranks) makes every method a no-op.
    ``config`` (a dict) is recorded as the wandb run config and TensorBoard text.
    """

    def __init__(self, lcfg: LoggingConfig, train_iters: int, enabled: bool,
                 config: dict | None = None, stream=None, device=None,
                 world_size: int = 1):
        self.lcfg = lcfg
        self.device = device if device is not None else "cpu"   # of --log-memory-to-tb
        self.world_size = world_size
        self.train_iters = train_iters
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._window = _Window()
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._total_elapsed = 0.0
        self._total_iters = 0
        self._config = config
        self.wandb_id: str | None = None   # the wandb run's id, once known (set_wandb_run)
        self._wandb_resume = False
        self.mfu_in_line = True   # False where the peak is a CPU probe, not a datasheet's
        if not enabled:
            return
        if lcfg.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(lcfg.metrics_jsonl)), exist_ok=True)
            self._jsonl = open(lcfg.metrics_jsonl, "a", buffering=1)  # noqa: SIM115 (closed in close())
        if lcfg.tensorboard_dir:
            self._tb = self._tensorboard()
            if config is not None:
                self._tb.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```")
        if lcfg.wandb_project:
            import wandb  # noqa: F401 (a missing wandb fails here, before any work)

    def _tensorboard(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=self.lcfg.tensorboard_dir,
                             max_queue=self.lcfg.tensorboard_queue_size, purge_step=purge_step)

    def set_wandb_run(self, run_id: str | None, resume: bool = False) -> None:
        """The wandb run to log to, before the first record: ``run_id`` (stored in the
        checkpoints, so a resumed job continues the same run with ``resume=True``)."""
        self.wandb_id, self._wandb_resume = run_id, resume

    def _wandb_run(self):
        """The wandb run, started at the first use (after :meth:`set_wandb_run`)."""
        if self._wandb is None and self.enabled and self.lcfg.wandb_project:
            import wandb

            lcfg = self.lcfg
            save_dir = lcfg.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            kwargs = {"id": self.wandb_id} if self.wandb_id else {}
            if self._wandb_resume:
                kwargs["resume"] = "allow"
            self._wandb = wandb.init(project=lcfg.wandb_project, name=lcfg.wandb_exp_name,
                                     dir=save_dir, config=self._config, **kwargs)
            self.wandb_id = self._wandb.id
        return self._wandb

    def resume_at(self, iteration: int) -> None:
        """The run resumes after ``iteration`` (a loaded checkpoint): the JSONL keeps only
        its rows up to ``iteration`` (rewritten atomically: a temporary file, then
        ``os.replace``) and TensorBoard purges its events after it, so the iterations that
        follow are not there twice."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            path = self.lcfg.metrics_jsonl
            self._jsonl.close()
            kept, dropped = [], 0
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:   # a torn last line of a killed run
                        dropped += 1
                        continue
                    if isinstance(row, dict) and row.get("iteration", 0) > iteration:
                        dropped += 1
                    else:
                        kept.append(line if line.endswith("\n") else line + "\n")
            if dropped:
                write_text_atomic(path, "".join(kept))
                self.print(f" resuming after iteration {iteration}: dropped {dropped} later "
                           f"row(s) from {path}")
            self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        if self._tb is not None:
            self._tb.close()
            self._tb = self._tensorboard(purge_step=iteration + 1)

    def print(self, message: str) -> None:
        """A line on stdout from the logging rank."""
        if self.enabled:
            print(message, file=self.stream, flush=True)

    # -- per iteration ------------------------------------------------------------------
    def record(self, m: IterationMetrics, extra: dict | None = None) -> None:
        """Write one iteration to JSONL / TensorBoard / wandb; print the human line every
        ``--log-interval`` iterations. ``extra`` adds keys to the JSONL object."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({**m.jsonl(), **(extra or {})}) + "\n")
        moe = _moe_values(extra)
        if m.iteration % self.lcfg.tensorboard_log_interval == 0:
            scalars = self.scalars(m, moe)
            if self._tb is not None:
                for key, value in scalars.items():
                    self._tb.add_scalar(key, value, m.iteration)
            if self._wandb_run() is not None:
                self._wandb.log({f"train/{k}": v for k, v in scalars.items()},
                                step=m.iteration)

        w = self._window
        w.iters += 1
        w.elapsed_s += m.elapsed_s
        w.skipped += int(m.skipped)
        if math.isfinite(m.lm_loss):  # a skipped fp16 step still has a finite loss
            w.loss_sum += m.lm_loss
            w.loss_count += 1
        w.tokens_per_sec, w.mfu, w.tflops_per_gpu = m.tokens_per_sec, m.mfu, m.tflops_per_gpu
        for key, value in moe.items():
            w.moe_sums[key] = w.moe_sums.get(key, 0.0) + value
        self._total_elapsed += m.elapsed_s
        self._total_iters += 1
        if m.iteration % self.lcfg.log_interval == 0 or m.iteration == self.train_iters:
            self.print(self.human_line(m))
            self._window = _Window()

    def scalars(self, m: IterationMetrics, moe: dict) -> dict:
        """The TensorBoard / wandb scalars of iteration ``m`` (Megatron-LM's names where it
        has them): the loss, lr, loss scale, grad norm, batch size ... and the MoE losses,
        memory (``--log-memory-to-tensorboard``) and world size
        (``--log-world-size-to-tensorboard``)."""
        lcfg = self.lcfg
        scalars = {"lm loss": m.lm_loss, "learning-rate": m.lr, "loss-scale": m.loss_scale,
                   "grad-norm": m.grad_norm, "skipped": float(m.skipped),
                   "tokens-per-sec": m.tokens_per_sec, "mfu": m.mfu,
                   "iteration-time": m.elapsed_s, "consumed-samples": m.consumed_samples,
                   "batch-size": m.global_batch_size or None, "num-zeros": m.num_zeros,
                   "params-norm": m.params_norm, "max_attention_logit": m.max_attention_logit}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        scalars.update({k.replace("_", "-"): v for k, v in moe.items()})
        if lcfg.log_world_size_to_tensorboard:
            scalars["world-size"] = self.world_size
        if lcfg.log_memory_to_tensorboard:
            from megalite.training.memory_log import tensorboard_memory_scalars

            scalars.update(tensorboard_memory_scalars(self.device))
        return scalars

    def human_line(self, m: IterationMetrics) -> str:
        """``iteration N/M | consumed samples: ... | ... | ETA ...`` over the window."""
        w = self._window
        per_iter_ms = 1000.0 * w.elapsed_s / max(w.iters, 1)
        loss = w.loss_sum / w.loss_count if w.loss_count else float("nan")
        avg_s = self._total_elapsed / max(self._total_iters, 1)
        eta = datetime.timedelta(seconds=round(avg_s * max(self.train_iters - m.iteration, 0)))
        grad = f"{m.grad_norm:.3f}" if m.grad_norm is not None else "skipped"
        zeros = f" num zeros: {m.num_zeros} |" if m.num_zeros is not None else ""
        params = f" params norm: {m.params_norm:.3f} |" if m.params_norm is not None else ""
        if m.max_attention_logit is not None:
            params += f" max attention logit: {m.max_attention_logit:.3f} |"
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        moe = "".join(f" {k.replace('_', ' ')}: {v / max(w.iters, 1):.6E} |"
                      for k, v in w.moe_sums.items())  # e.g. " moe aux loss: ... |"
        throughput = (f" throughput per GPU (TFLOP/s/GPU): {w.tflops_per_gpu:.1f} |"
                      if self.lcfg.log_throughput else "")
        mfu = f" MFU: {100.0 * w.mfu:.2f}% |" if self.mfu_in_line else ""
        return (f" [{stamp}] iteration {m.iteration:8d}/{self.train_iters:8d} |"
                f" consumed samples: {m.consumed_samples:12d} |"
                f" elapsed time per iteration (ms): {per_iter_ms:.1f} |"
                f" learning rate: {m.lr:.6E} |"
                f" global batch size: {m.global_batch_size:5d} |"
                f" lm loss: {loss:.6E} |{moe}"
                f" loss scale: {m.loss_scale:.1f} |"
                f" grad norm: {grad} |"
                f"{zeros}{params}"
                f" number of skipped iterations: {w.skipped:3d} |"
                f"{throughput}"
                f" tokens/s: {w.tokens_per_sec:.1f} |"
                f"{mfu}"
                f" ETA: {eta} |")

    # -- evaluation ---------------------------------------------------------------------
    def record_eval(self, iteration: int, loss: float, label: str = "validation",
                    at: str | None = None) -> None:
        """Print the evaluation loss and perplexity at ``iteration`` (``at``: other words
        for when, e.g. ``the end of training``) and send them to TensorBoard / wandb (the
        JSONL gets them through :meth:`record`'s ``extra``)."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        text = (f" {label} loss at {at or f'iteration {iteration}'} |"
                f" lm loss value: {loss:.6E} |"
                f" lm loss PPL: {ppl:.6E} |")
        bar = "-" * len(text)
        self.print(f"{bar}\n{text}\n{bar}")
        if self._tb is not None:
            self._tb.add_scalar(f"lm loss {label}", loss, iteration)
            if self.lcfg.log_validation_ppl_to_tensorboard:
                self._tb.add_scalar(f"lm loss {label} ppl", ppl, iteration)
        if self._wandb_run() is not None:
            self._wandb.log({f"{label}/lm loss": loss, f"{label}/ppl": ppl}, step=iteration)

    def record_timers(self, iteration: int, times: dict[str, float]) -> None:
        """``--log-timers-to-tensorboard``: each timer as the TensorBoard scalar
        ``<name>-time`` (ms per iteration over the log window, :meth:`Timers.ms_per`)."""
        if self.enabled and self._tb is not None and self.lcfg.log_timers_to_tensorboard:
            for name, ms in times.items():
                self._tb.add_scalar(f"{name}-time", ms, iteration)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
