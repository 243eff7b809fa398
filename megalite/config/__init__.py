"""Typed configuration for megalite.

Every setting is a field of one of the section dataclasses, one module each: ``model``,
``parallel``, ``optim``, ``data``, ``run`` (train, checkpoint, logging) and ``combined``
(:class:`MegaliteConfig`). The field name is the Megatron-LM flag name with dashes turned
into underscores (``tensor_model_parallel_size`` is ``--tensor-model-parallel-size``);
``megalite.arguments`` generates the command line from these fields (declared with
:func:`~megalite.config.fields.arg`), so a flag is declared exactly once, here.

Validation that concerns one section lives in that section's ``__post_init__``; checks that
relate sections (heads vs tensor parallel size, batch sizes vs data parallel size, world size
vs the parallel layout) live in :meth:`MegaliteConfig.validate`. Every problem raises
:class:`ConfigError` with one sentence that names the values and how to fix them.
"""

from __future__ import annotations

from megalite.config.combined import SECTIONS, MegaliteConfig
from megalite.config.data import DataConfig
from megalite.config.fields import ConfigError, arg
from megalite.config.model import ModelConfig
from megalite.config.optim import OptimConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.run import CheckpointConfig, LoggingConfig, TrainConfig

__all__ = ["SECTIONS", "CheckpointConfig", "ConfigError", "DataConfig", "LoggingConfig",
           "MegaliteConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig",
           "arg"]
