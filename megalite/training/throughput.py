"""The built model's transformer-layer parameter count, as the training log reports it.

MFU = (model FLOPs of one iteration / iteration time) / (peak FLOP/s per rank x ranks): the
FLOPs come from the resolved layout (``Layout.flops_per_token``,
:mod:`megalite.config.shapes`), the peak from :mod:`megalite.hardware`.
"""

from __future__ import annotations

import torch

from megalite.optim.clip_grads import counts_in_norm
from megalite.parallel.collectives import all_reduce_scalar
from megalite.parallel.state import ParallelState


def count_layer_params(model: torch.nn.Module, ps: ParallelState) -> int:
    """Parameters of the whole model but embeddings and output layer, each counted once
    (tensor-parallel shards summed, replicated parameters once: SUM over ``ps.mp``)."""
    local = sum(p.numel() for name, p in model.named_parameters()
                if counts_in_norm(p, ps) and "embedding" not in name
                and "output_layer" not in name)
    return int(all_reduce_scalar(local, ps.mp, device=ps.device))
