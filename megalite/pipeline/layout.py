"""A rank's pipeline chunks as modules. Which layers each chunk holds is part of the
resolved layout (``ResolvedLayout.stage_chunks``, from
:func:`megalite.config.layout.chunk_layer_ranges`)."""

from __future__ import annotations

import torch


def model_chunks(model) -> list[torch.nn.Module]:
    """This rank's pipeline chunks: the items of a ModuleList / list / tuple of chunks
    (what ``training.build`` makes under pipeline parallelism), or the one module."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]
