"""Helpers of the CUDA tests: configurations that ask for the GPU explicitly (``--device
cuda`` wins over the ``MEGALITE_DEVICE=cpu`` the suite sets) and a deterministic mode."""

from __future__ import annotations

import contextlib

import torch

from megalite.config import ParallelConfig
from megalite.parallel.state import ParallelState
from tests.training.common import tiny_config

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def config_on(device: torch.device, world_size: int = 1, **sections):
    """:func:`tests.training.common.tiny_config` with ``--device`` set to ``device``."""
    parallel = {**sections.pop("parallel", {}), "device": device.type}
    return tiny_config(world_size, parallel=parallel, **sections)


def state_on(device: torch.device) -> ParallelState:
    return ParallelState.build(ParallelConfig(device=device.type))


@contextlib.contextmanager
def deterministic():
    """Deterministic CUDA kernels (warn where an op has none) for bitwise comparisons."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
