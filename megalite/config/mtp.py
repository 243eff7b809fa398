"""Multi-token prediction (``--mtp-num-layers``, ``--mtp-loss-scaling-factor``): the checks.

The model side is :mod:`megalite.transformer.mtp`; here only what the flags may be and
what they may be combined with.
"""

from __future__ import annotations

import math

from megalite.config.fields import require


def check_mtp(m) -> None:
    """``ModelConfig``'s own checks of the two flags (``m`` a ModelConfig)."""
    n = m.mtp_num_layers
    require(n is None or n >= 0,
            f"--mtp-num-layers must be >= 0 (0 or unset: no multi-token prediction), got {n}")
    scale = m.mtp_loss_scaling_factor
    require(math.isfinite(scale) and scale >= 0,
            f"--mtp-loss-scaling-factor must be a finite number >= 0, got {scale}")


def check_mtp_layout(m, p) -> None:
    """The flags against the parallel layout (``m`` ModelConfig, ``p`` ParallelConfig).

    The depths run on the stage with the output layer after its decoder layers and look up
    the shifted tokens in the word embedding, which that stage holds as a copy of the first
    stage's (kept equal by summing its gradient over ``ps.embedding``). Under a V schedule
    (zbv, dualpipev) that stage is the first pipeline rank itself (chunk 1 beside chunk 0's
    embedding): its copy's gradient is summed on the rank. A learned absolute position
    table has no such copy, so that combination is refused under pipeline parallelism,
    V schedules included. (A last stage without decoder layers cannot be asked for:
    ``--decoder-last-pipeline-num-layers`` must be >= 1, ``ParallelConfig``.)"""
    if not m.mtp_num_layers:
        return
    pp = p.pipeline_model_parallel_size
    where = ("the output layer's model chunk" if p.pipeline_schedule in ("zbv", "dualpipev")
             else "the last stage")
    require(not (m.learned_positions and pp > 1),
            f"--mtp-num-layers {m.mtp_num_layers} with learned absolute position embeddings "
            f"and --pipeline-model-parallel-size {pp} is not supported: {where} would "
            "need a copy of the position table; use --position-embedding-type rope (or "
            "none), or pipeline-model-parallel-size 1")
