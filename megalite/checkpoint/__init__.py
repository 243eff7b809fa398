"""Distributed checkpoints that reshard on load, built on torch.distributed.checkpoint.

The training loop calls only :func:`save_checkpoint` (through a :class:`CheckpointSaver`
for ``--async-save``) and :func:`load_checkpoint`. Every tensor is saved with its global
shape and the block each rank holds, so ``--load`` works under any tp / pp / vpp / dp /
ep layout (:mod:`.layout`, :mod:`.planner`); see :mod:`.files` for the directory layout
and :mod:`.save` for crash safety. :mod:`.consolidated` turns a checkpoint into one full
state dict and back (the Hugging Face converter uses it).
"""

from megalite.checkpoint.files import (
    LATEST,
    CheckpointError,
    find_iteration,
    iteration_dir,
    read_latest_iteration,
)
from megalite.checkpoint.load import LoadedCheckpoint, LoadOptions, load_checkpoint
from megalite.checkpoint.save import CheckpointSaver, save_checkpoint

__all__ = ["LATEST", "CheckpointError", "CheckpointSaver", "LoadOptions", "LoadedCheckpoint",
           "find_iteration", "iteration_dir", "load_checkpoint", "read_latest_iteration",
           "save_checkpoint"]
