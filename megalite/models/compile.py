"""``torch.compile`` of a model's transformer layers (``--compile``, regional compilation).

Each :class:`~megalite.transformer.layer.TransformerLayer` is compiled on its own
(``Module.compile``): identical layers share one compiled graph (the parameters are graph
inputs, not constants), so compile time does not grow with depth, and what surrounds the
layers (embedding, rotary tables, output layer, vocabulary-parallel cross entropy, pipeline
transfers, recomputation wrappers) stays eager. Shapes are static (``dynamic=False``): a
training run has one micro-batch shape, and a new shape (evaluation with another batch
size) compiles once more.

Callers: the training build (``--compile``, ``megalite.training.build``) and the model
benchmarks (``tools/benchmark.py model --compile``, ``tools/benchmark.py gpu``).
"""

from __future__ import annotations

import torch

from megalite.config import ConfigError

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (a GPTModel, or a ModuleList of pipeline chunks) whose class
    is named ``TransformerLayer``, in order."""
    return [m for m in model.modules() if type(m).__name__ == "TransformerLayer"]


def eager_parts(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The sub-modules of a transformer layer that stay eager inside its compiled region
    (the layer's graph breaks around them):

    * a mixture-of-experts MLP (``layer.is_moe``): its token routing has data-dependent
      shapes (``nonzero``, per-expert counts), which would recompile at every step;
    * the attention block under selective recomputation (``recompute_core``, or
      multi-latent attention's ``recompute_up_proj``) and a dense MLP under
      ``--recompute-modules mlp`` (``recompute_mlp``): they checkpoint with a
      ``context_fn`` that replays the dropout RNG, which ``torch.compile`` cannot trace.
    """
    parts = []
    attention = getattr(layer, "self_attention", None)
    if attention is not None and (getattr(attention, "recompute_core", False)
                                  or getattr(attention, "recompute_up_proj", False)):
        parts.append(attention)
    if getattr(layer, "is_moe", False) or getattr(layer, "recompute_mlp", False):
        parts.append(layer.mlp)
    return parts


def compile_model(model: torch.nn.Module, *, mode: str | None = None,
                  per_layer: bool = True, **compile_kwargs) -> torch.nn.Module:
    """Compile ``model`` in place and return it.

    ``per_layer`` (the default) compiles each transformer layer (:func:`transformer_layers`);
    without such layers, or with ``per_layer=False``, the whole forward is compiled.
    ``mode`` and ``compile_kwargs`` go to ``torch.compile``.
    """
    if mode not in COMPILE_MODES:
        raise ConfigError(f"unknown torch.compile mode {mode!r}; choose one of "
                          f"{', '.join(m for m in COMPILE_MODES if m)}")
    kwargs = {"dynamic": False, **compile_kwargs}
    if mode is not None:
        kwargs["mode"] = mode
    layers = transformer_layers(model) if per_layer else []
    for layer in layers:
        for part in eager_parts(layer):
            part.forward = torch.compiler.disable(part.forward, recursive=True)
        layer.compile(**kwargs)
    if not layers:
        model.compile(**kwargs)
    return model


def maybe_compile(model: torch.nn.Module, enabled: bool = True, **kwargs) -> torch.nn.Module:
    """:func:`compile_model` when ``enabled``, else ``model`` unchanged."""
    return compile_model(model, **kwargs) if enabled else model
