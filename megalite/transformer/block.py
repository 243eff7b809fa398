"""A stack of transformer layers with optional full activation recomputation."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint

from megalite.transformer.activation_offload import build_activation_offload
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.norms import build_norm


class TransformerBlock(torch.nn.Module):
    """Layers ``first_layer .. first_layer + num_layers - 1`` (global numbers, so a pipeline
    stage's parameter names match the single-stage model), ``[s, b, h]`` -> ``[s, b, h]``
    (``[s/tp, b, h]`` under sequence parallelism). ``post_process`` adds the final norm.

    ``--recompute-granularity full`` checkpoints whole layers (non-reentrant, RNG streams
    replayed): ``uniform`` in chunks of ``recompute_num_layers`` layers, ``block`` only the
    first ``recompute_num_layers`` layers of this stage, one by one.

    ``--cpu-offloading``: the first ``cpu_offloading_num_layers`` layers of this chunk that
    are not recomputed (none under ``uniform``, which recomputes every layer) keep their
    saved activations in host memory (:mod:`megalite.transformer.activation_offload`).

    ``ps`` (the ParallelState) and ``seed`` reach every layer (see :class:`TransformerLayer`).
    """

    def __init__(self, cfg, ps, *, sequence_parallel: bool, rng, first_layer: int = 0,
                 num_layers: int | None = None, post_process: bool = True,
                 seed: int = 0, device=None, dtype=None):
        super().__init__()
        num_layers = cfg.num_layers - first_layer if num_layers is None else num_layers
        self.rng = rng
        self.recompute = cfg.recompute_granularity == "full"
        self.recompute_method = cfg.recompute_method
        self.recompute_num_layers = cfg.recompute_num_layers
        self.offload = build_activation_offload(cfg, ps)
        self.layers = torch.nn.ModuleDict({
            str(i): TransformerLayer(cfg, i, ps, sequence_parallel=sequence_parallel, rng=rng,
                                     seed=seed, device=device, dtype=dtype)
            for i in range(first_layer, first_layer + num_layers)})
        self.final_layernorm = None
        if post_process:
            self.final_layernorm = build_norm(cfg.normalization, cfg.hidden_size,
                                              cfg.norm_epsilon,
                                              sequence_parallel=sequence_parallel,
                                              zero_centered=cfg.apply_layernorm_1p,
                                              device=device, dtype=dtype)

    @staticmethod
    def _run(layers, x, rotary, document_ids=None):
        for layer in layers:
            x = layer(x, rotary, document_ids)
        return x

    def _checkpointed(self, layers, x, rotary, document_ids=None):
        return checkpoint(self._run, layers, x, rotary, document_ids, use_reentrant=False,
                          context_fn=self.rng.recompute_context_fn)

    def forward(self, x: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                document_ids: torch.Tensor | None = None,
                inference_cache=None) -> torch.Tensor:
        """``document_ids`` ``[b, s]`` (whole sequence): attention stays in documents.
        ``inference_cache`` (generation only): each layer reads and extends its KV cache."""
        layers = list(self.layers.values())
        if inference_cache is not None:
            for layer in layers:
                x = layer(x, rotary, document_ids, inference_cache=inference_cache)
            return x if self.final_layernorm is None else self.final_layernorm(x)
        if rotary is not None:  # cast once for all layers (a no-op in fp32)
            rotary = (rotary[0].to(x.dtype), rotary[1].to(x.dtype))
        offload = (self.offload.forward() if self.offload is not None and self.training
                   and torch.is_grad_enabled() else None)
        if not (self.recompute and self.training and torch.is_grad_enabled()):
            if offload is None:
                x = self._run(layers, x, rotary, document_ids)
            else:
                for i, layer in enumerate(layers):
                    with offload.layer(i, layer):
                        x = layer(x, rotary, document_ids)
        elif self.recompute_method == "uniform":
            n = self.recompute_num_layers
            for start in range(0, len(layers), n):
                x = self._checkpointed(layers[start:start + n], x, rotary, document_ids)
        else:  # block
            for i, layer in enumerate(layers):
                if i < self.recompute_num_layers:
                    x = self._checkpointed([layer], x, rotary, document_ids)
                else:
                    n = self.recompute_num_layers   # offload counts the plain layers
                    with offload.layer(i - n, layer) if offload is not None else nullcontext():
                        x = layer(x, rotary, document_ids)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
