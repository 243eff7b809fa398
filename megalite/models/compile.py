"""Optional ``torch.compile`` of a model (``--compile`` in the benchmark and training)."""

from __future__ import annotations

import torch


def maybe_compile(model: torch.nn.Module, enabled: bool = True, *,
                  per_layer: bool = True, **compile_kwargs) -> torch.nn.Module:
    """Compile ``model`` in place and return it (unchanged when not ``enabled``).

    ``per_layer`` compiles each transformer layer (regional compilation): identical layers
    share one compiled graph, so compile time does not grow with depth, and the
    embedding, collectives and vocabulary-parallel cross entropy stay eager. Otherwise
    the whole model's forward is compiled. Works on CPU (inductor's C++ backend) and CUDA.
    """
    if not enabled:
        return model
    layers = [m for name, m in model.named_modules()
              if type(m).__name__ == "TransformerLayer"] if per_layer else []
    if layers:
        for layer in layers:
            layer.compile(**compile_kwargs)
    else:
        model.compile(**compile_kwargs)
    return model
