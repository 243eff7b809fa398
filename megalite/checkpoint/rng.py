"""Capture and restore every random-number generator a training rank uses.

One rank's state is a dict: python ``random``, numpy, torch CPU, every CUDA device (when
present) and the model-parallel :class:`megalite.parallel.random.RNGTracker` streams
(dropout) when the model has a tracker. Checkpoints store the list of these dicts over the
data-parallel group (see :func:`gather_rng_states`), so every rank resumes its own streams.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megalite.parallel import collectives
from megalite.parallel.state import Group


def capture_rng_state(tracker=None) -> dict:
    """This rank's generator states (``tracker``: an object with ``get_states()``)."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": tracker.get_states() if tracker is not None else None,
    }
    return state


def restore_rng_state(state: dict, tracker=None) -> None:
    """Inverse of :func:`capture_rng_state`. A tracker state is restored only when both
    the checkpoint and the model have one."""
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if tracker is not None and state.get("tracker") is not None:
        tracker.set_states(state["tracker"])


def gather_rng_states(group: Group, tracker=None) -> list[dict]:
    """Every rank's state over ``group`` (all-gather of python objects), in group order."""
    return collectives.all_gather_object(capture_rng_state(tracker), group)
