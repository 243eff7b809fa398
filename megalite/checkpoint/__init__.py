"""Saving and loading training checkpoints.

The rest of megalite calls only :func:`save_checkpoint` and :func:`load_checkpoint`, so
the on-disk format (today one ``torch.save`` file per model-parallel rank, see
:mod:`megalite.checkpoint.per_rank`) can change without touching the training loop.
"""

from megalite.checkpoint.per_rank import (
    LATEST,
    CheckpointError,
    LoadedCheckpoint,
    iteration_dir,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)

__all__ = ["LATEST", "CheckpointError", "LoadedCheckpoint", "iteration_dir",
           "load_checkpoint", "read_latest_iteration", "save_checkpoint"]
