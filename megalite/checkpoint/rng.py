"""Capture and restore every random-number generator a training rank uses.

One rank's state is a dict: python ``random``, numpy, torch CPU, the generator of the CUDA
device this rank runs on (only when megalite chose a CUDA device,
:func:`megalite.parallel.device.select_device`: a GPU host run with ``--device cpu``
never initialises CUDA here) and the model-parallel
:class:`megalite.parallel.random.RNGTracker` streams (dropout) when the model has a
tracker. Checkpoints store one such dict per rank, so every rank resumes its own streams.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def _on_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def capture_rng_state(tracker=None, device=None) -> dict:
    """This rank's generator states (``tracker``: an object with ``get_states()``;
    ``device``: the rank's device; its CUDA generator is captured only when it is one)."""
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(torch.device(device)) if _on_cuda(device) else None,
        "tracker": tracker.get_states() if tracker is not None else None,
    }


def restore_rng_state(state: dict, tracker=None, device=None) -> None:
    """Inverse of :func:`capture_rng_state` on ``device``. A CUDA generator state is
    restored only onto a CUDA device (a checkpoint saved on GPUs resumes on CPU without
    it); a tracker state only when both the checkpoint and the model have one."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and _on_cuda(device):
        if isinstance(cuda, (list, tuple)):  # an older save: every visible device's state
            cuda = cuda[torch.device(device).index or 0] if cuda else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, torch.device(device))
    if tracker is not None and state.get("tracker") is not None:
        tracker.set_states(state["tracker"])
