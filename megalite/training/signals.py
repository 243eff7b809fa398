"""Graceful exit on a signal (``--exit-signal-handler``).

A scheduler (SLURM, Kubernetes, torchrun) sends SIGTERM some time before killing a job.
The handler only records that the signal came; the training loop asks, once per
iteration, whether any rank received it (a MAX all-reduce over the whole world, so every
rank stops at the same iteration), then saves a checkpoint and exits with status 0.

    with SignalHandler(enabled=cfg.train.exit_signal_handler) as handler:
        ...
        if handler.any_rank_received(): save(); break
"""

from __future__ import annotations

import signal

import torch
from typing_extensions import Self

from megalite.parallel.collectives import ReduceOp, all_reduce_scalar


class SignalHandler:
    """Records whether ``sig`` arrived while the ``with`` block runs; restores the
    previous handler on exit. Disabled, it installs nothing and never reports a signal."""

    def __init__(self, enabled: bool = True, sig: int = signal.SIGTERM):
        self.enabled = enabled
        self.sig = sig
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> Self:
        if self.enabled:
            self._previous = signal.signal(self.sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        """Restore the previous handler; after a received signal, ignore further ones
        instead: the process is already stopping because of the first, and a repeat (a
        scheduler signals the launcher and its workers, the launcher forwards it too)
        must not kill it while it cleans up. A scheduler that wants it gone sends SIGKILL."""
        if self.enabled:
            signal.signal(self.sig, signal.SIG_IGN if self.received else self._previous)

    def any_rank_received(self, device: torch.device | None = None) -> bool:
        """True on every rank if any rank got the signal (MAX all-reduce over the world).
        Collective: every rank must call it at the same point when enabled."""
        if not self.enabled:
            return False
        return all_reduce_scalar(float(self.received), None, ReduceOp.MAX, device) > 0
