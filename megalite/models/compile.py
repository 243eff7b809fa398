"""Optional ``torch.compile`` of a model.

Its one caller is the model benchmark: ``python tools/benchmark.py model --compile``
(tools/bench/model.py) times a compiled single-process GPTModel beside the eager one.
Training does not compile: ``pretrain/pretrain_gpt.py`` has no ``--compile`` flag and
nothing else in megalite calls :func:`maybe_compile`.
"""

from __future__ import annotations

import torch


def maybe_compile(model: torch.nn.Module, enabled: bool = True, *,
                  per_layer: bool = True, **compile_kwargs) -> torch.nn.Module:
    """Compile ``model`` in place and return it (unchanged when not ``enabled``).

    ``per_layer`` compiles each module whose class is named ``TransformerLayer`` (regional
    compilation): identical layers share one compiled graph, so compile time does not grow
    with depth, and the embedding, output layer and vocabulary-parallel cross entropy stay
    eager; with tp > 1 a layer's collectives fall inside the compiled region (only tp = 1
    is benchmarked). A model without such layers, or ``per_layer=False``, has its whole
    forward compiled.
    ``compile_kwargs`` go to ``Module.compile`` (``torch.compile``'s arguments).
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
