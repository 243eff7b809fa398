"""Model-parallel RNG tracker: named random streams for dropout.

Dropout must draw *identical* masks on tensor-parallel ranks where activations are
replicated (hidden states without sequence parallelism) and *distinct* masks where each
rank holds a different shard (attention heads, sequence-parallel chunks). The tracker
keeps one generator state per stream and swaps it into the device's default generator
for the duration of :meth:`RNGTracker.fork`, so any dropout implementation (``F.dropout``,
SDPA, flash-attn) draws from the chosen stream; the model never consumes the global RNG.

Streams (seeds as in Megatron-LM, offset by the pipeline rank so stages differ):

* ``REPLICATED``      seed + 100 * pp_rank                 same on every TP rank
* ``TENSOR_PARALLEL`` seed + 100 * pp_rank + 2718 + tp_rank  distinct per TP rank

Activation recomputation replays the streams: :meth:`RNGTracker.recompute_context_fn`
builds the ``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant) that restores
the states the forward pass saw, so recomputed dropout masks match.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

REPLICATED = "replicated"
TENSOR_PARALLEL = "tensor-parallel"


def stage_seed(seed: int, ps) -> int:
    """The seed of this rank's pipeline stage: ``seed + 100 * pp_rank`` (stages differ,
    tensor/data-parallel ranks of one stage agree). The one place this rule lives: the
    global RNGs at start-up, the dropout streams and a re-seeded resume all use it."""
    return seed + 100 * ps.pp.rank


def _get_device_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The default-generator state that ``manual_seed(seed)`` would give on ``device``."""
    saved = _get_device_state(device)
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return _get_device_state(device)
    finally:
        _set_device_state(device, saved)


class RNGTracker:
    """Named RNG streams on ``device``; build one per model with :meth:`from_state`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    @classmethod
    def from_state(cls, ps, seed: int) -> RNGTracker:
        """The two standard streams for this rank of ``ps`` (see module docstring)."""
        tracker = cls(ps.device)
        base = stage_seed(seed, ps)
        tracker.add(REPLICATED, base)
        tracker.add(TENSOR_PARALLEL, base + 2718 + ps.tp.rank)
        return tracker

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.states[name] = _seeded_state(self.device, seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    @contextmanager
    def fork(self, name: str):
        """Run the body with stream ``name`` as the device's default generator."""
        if name not in self.states:
            raise KeyError(f"unknown RNG stream {name!r}; have {sorted(self.states)}")
        outside = _get_device_state(self.device)
        _set_device_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_state(self.device)
            _set_device_state(self.device, outside)

    @contextmanager
    def replay(self, states: dict[str, torch.Tensor]):
        """Temporarily rewind the streams to ``states`` (for a recomputed forward)."""
        current = self.states
        self.set_states(states)
        try:
            yield
        finally:
            self.states = current

    def recompute_context_fn(self):
        """``context_fn`` for ``torch.utils.checkpoint(use_reentrant=False)``.

        Called when the checkpointed forward starts: snapshots the streams and returns
        (forward context, recompute context); the latter replays the snapshot.
        """
        snapshot = self.get_states()
        return nullcontext(), self.replay(snapshot)
