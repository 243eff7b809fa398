"""Graceful exit on a signal (``--exit-signal-handler``, ``--exit-signal``).

A scheduler (SLURM, Kubernetes, torchrun) sends SIGTERM (or the signal it is configured
with: ``--exit-signal SIGUSR1`` ...) some time before killing a job, and a user at a
terminal presses Ctrl-C, which sends SIGINT to every process of the job at once. The
handler only records that one of them came; the training loop asks, once per iteration,
whether any rank received one (a MAX all-reduce over the whole world, so every rank stops
at the same iteration), then saves a checkpoint and exits with status 0.

    with SignalHandler(enabled=cfg.train.exit_signal_handler,
                       sigs=exit_signals(cfg.train.exit_signal)) as handler:
        ...
        if handler.any_rank_received(): save(); break
"""

from __future__ import annotations

import signal

import torch
from typing_extensions import Self

from megalite.parallel.collectives import ReduceOp, all_reduce_scalar


def exit_signals(name: str) -> tuple[int, ...]:
    """The signals a run with ``--exit-signal name`` stops on: that one and SIGINT
    (Ctrl-C)."""
    return tuple(dict.fromkeys((signal.Signals[name], signal.SIGINT)))


class SignalHandler:
    """Records whether one of ``sigs`` arrived while the ``with`` block runs; restores the
    previous handlers on exit. Disabled, it installs nothing and never reports a signal."""

    def __init__(self, enabled: bool = True, sigs: tuple[int, ...] = (signal.SIGTERM,)):
        self.enabled = enabled
        self.sigs = tuple(sigs)
        self.received = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> Self:
        if self.enabled:
            self._previous = {s: signal.signal(s, self._handle) for s in self.sigs}
        return self

    def __exit__(self, *exc) -> None:
        """Restore the previous handler; after a received signal, ignore further ones
        instead: the process is already stopping because of the first, and a repeat (a
        scheduler signals the launcher and its workers, the launcher forwards it too)
        must not kill it while it cleans up. A scheduler that wants it gone sends SIGKILL."""
        for s, previous in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.received else previous)

    def any_rank_received(self, device: torch.device | None = None) -> bool:
        """True on every rank if any rank got the signal (MAX all-reduce over the world).
        Collective: every rank must call it at the same point when enabled."""
        if not self.enabled:
            return False
        return all_reduce_scalar(float(self.received), None, ReduceOp.MAX, device) > 0
