"""Tiny configurations and helpers shared by the training tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import torch

from megalite.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    MegaliteConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRYPOINT = os.path.join(REPO, "pretrain", "pretrain_gpt.py")


def tiny_config(world_size: int = 1, **sections) -> MegaliteConfig:
    """A validated config for a 2-layer, hidden-32 GPT on mock data (NullTokenizer).

    ``sections``: ``model={...}, parallel={...}, optim={...}, train={...}, checkpoint={...},
    logging={...}, data={...}`` field overrides.
    """
    kw = {
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                      "vocab_size": 60, "make_vocab_size_divisible_by": 8, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "attention_backend": "sdpa"},
        "parallel": {},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 1, "lr_decay_style": "cosine",
                      "weight_decay": 0.01},
        "data": {"mock_data": True, "tokenizer_type": "NullTokenizer"},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8, "eval_iters": 0,
                      "eval_interval": 4, "seed": 1234},
        "checkpoint": {},
        "logging": {"log_interval": 1000},
    }
    for name, overrides in sections.items():
        kw[name].update(overrides)
    cfg = MegaliteConfig(model=ModelConfig(**kw["model"]),
                         parallel=ParallelConfig(**kw["parallel"]),
                         optim=OptimConfig(**kw["optim"]), data=DataConfig(**kw["data"]),
                         train=TrainConfig(**kw["train"]),
                         checkpoint=CheckpointConfig(**kw["checkpoint"]),
                         logging=LoggingConfig(**kw["logging"]))
    return cfg.validate(world_size)


def run_training(cfg: MegaliteConfig, **build_kwargs):
    """Build (in this process's world) and train; returns (TrainResult, components)."""
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from megalite.training.loop import train

    ps = ParallelState.build(cfg.parallel)
    build_kwargs.setdefault("peak_probe_seconds", 0.01)
    components = build_components(cfg, ps, **build_kwargs)
    try:
        result = train(components)
    finally:
        components.close()
        ps.destroy()
    return result, components


def megatron_script_argv(script: str, sizes: dict, skip=()) -> list[str]:
    """The flags of one of ``tools/megatron_flags.py``'s Megatron-LM scripts (``script``:
    its name there, e.g. ``"DEEPSEEK_V3"``), each value in ``sizes`` put in its flag's
    place and the flags in ``skip`` left out: the script "with only sizes, parallel sizes
    and paths changed"."""
    from tests.tools import load_tool

    flags = load_tool("megatron_flags")
    argv = []
    for flag, values in flags.split_flags(getattr(flags, script)):
        if flag not in skip:
            argv += [flag, *([sizes[flag]] if flag in sizes else values)]
    return argv


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tiny_flags(**overrides) -> list[str]:
    """Command-line flags of :func:`tiny_config` for subprocess runs of the entrypoint."""
    flags = {
        "--num-layers": 2, "--hidden-size": 32, "--num-attention-heads": 4,
        "--seq-length": 16, "--vocab-size": 60, "--make-vocab-size-divisible-by": 8,
        "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--attention-backend": "sdpa",
        "--lr": 3e-3, "--min-lr": 3e-4, "--lr-warmup-iters": 1, "--lr-decay-style": "cosine",
        "--mock-data": None, "--tokenizer-type": "NullTokenizer", "--micro-batch-size": 2,
        "--global-batch-size": 8, "--train-iters": 8, "--eval-iters": 0,
        "--log-interval": 1, "--distributed-backend": "gloo",
    }
    flags.update(overrides)
    argv = []
    for key, value in flags.items():
        if value is False:
            continue
        argv.append(key)
        if value is not None and value is not True:
            argv.append(str(value))
    return argv


def subprocess_env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


PYTHON = sys.executable


def start_two_ranks(flags: list[str], stderr=subprocess.PIPE) -> list[subprocess.Popen]:
    """The entrypoint as the two ranks of a world of two, plain processes with torchrun's
    environment variables (no torchrun: each rank's own exit code is kept); text stdout
    piped, stderr as given. The master port is a free one picked just before."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [subprocess.Popen([PYTHON, ENTRYPOINT, *flags], stdout=subprocess.PIPE,
                             stderr=stderr, text=True,
                             env=subprocess_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(2)]


def params_snapshot(model: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def only_iteration(src: str, dst: str, iteration: int) -> str:
    """A new checkpoint directory ``dst`` holding only ``iteration`` of ``src`` (its
    latest): resuming from it starts exactly there."""
    from megalite.checkpoint import LATEST

    os.makedirs(dst)
    shutil.copytree(os.path.join(src, f"iter_{iteration:07d}"),
                    os.path.join(dst, f"iter_{iteration:07d}"))
    with open(os.path.join(dst, LATEST), "w") as f:
        f.write(f"{iteration}\n")
    return dst


class _NaNBackward(torch.autograd.Function):
    """Identity forward; NaN gradients backward."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class FaultAtCalls(torch.nn.Module):
    """The model, but the forward calls (1-based) that ``bad(call)`` picks give a NaN loss
    (``grad=False``), or a finite loss whose backward yields NaN gradients (``grad=True``)."""

    def __init__(self, inner, bad, grad: bool = False):
        super().__init__()
        self.inner, self.bad, self.grad, self.calls = inner, bad, grad, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        loss = self.inner(*args, **kwargs)
        if not self.bad(self.calls):
            return loss
        return _NaNBackward.apply(loss) if self.grad else loss * float("nan")
