"""One pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(.))."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megalite.layers.fp8 import Fp8Recipe
from megalite.moe.layer import MoELayer, moe_layer_pattern
from megalite.parallel.random import REPLICATED, TENSOR_PARALLEL
from megalite.transformer.attention import SelfAttention
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.mlp import MLP
from megalite.transformer.norms import build_norm


def output_init_std(cfg) -> float:
    """Megatron's scaled init of the projections that write into the residual stream."""
    return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)


class TransformerLayer(torch.nn.Module):
    """``[s, b, h]`` -> ``[s, b, h]``; ``[s/tp, b, h]`` under sequence parallelism.

    ``layer_number`` is the global (0-based) index in the whole model. The MLP is an
    :class:`~megalite.moe.layer.MoELayer` (Mixtral) when ``cfg.num_experts`` is set and
    ``moe_layer_pattern(cfg)`` selects this layer (it draws its own parameters from
    ``seed``); ``--recompute-modules mlp`` checkpoints a dense MLP, ``moe`` an MoE layer's
    dispatch and experts (:class:`~megalite.moe.layer.MoELayer`), ``layernorm`` the two
    norms (their inner activations are recomputed in backward; their outputs stay saved
    by the layers that read them). ``ps`` is the
    ParallelState every sub-layer picks its groups from. Residual-branch dropout draws
    from the replicated RNG stream (identical on TP ranks, which hold the same
    activations) or, under sequence parallelism, the tensor-parallel stream (each rank
    holds a different chunk of the sequence).
    """

    def __init__(self, cfg, layer_number: int, ps, *, sequence_parallel: bool, rng,
                 seed: int = 0, device=None, dtype=None, spec_layer: int | None = None):
        super().__init__()
        self.layer_number = layer_number
        # the decoder layer whose kind (MLP or MoE, fp8 recipe) this one has: itself, or
        # the last one for a multi-token prediction depth (megalite.transformer.mtp)
        spec_layer = layer_number if spec_layer is None else spec_layer
        self.rng = rng
        self.hidden_dropout = cfg.hidden_dropout
        self.dropout_stream = TENSOR_PARALLEL if sequence_parallel else REPLICATED
        kw = {"sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        # the linears' fp8 recipe (None: higher precision; --first-last-layers-bf16)
        fp8 = Fp8Recipe.for_layer(cfg, spec_layer)
        par = dict(output_std=output_init_std(cfg), fp8=fp8, **kw)
        norm = dict(zero_centered=cfg.apply_layernorm_1p, **kw)
        self.input_layernorm = build_norm(cfg.normalization, cfg.hidden_size,
                                          cfg.norm_epsilon, **norm)
        if cfg.multi_latent_attention:
            self.self_attention = MLASelfAttention(cfg, ps, rng=rng, **par)
        else:
            self.self_attention = SelfAttention(
                cfg, ps, rng=rng, recompute_core=cfg.recomputes("core_attn"), **par)
        self.pre_mlp_layernorm = build_norm(cfg.normalization, cfg.hidden_size,
                                            cfg.norm_epsilon, **norm)
        self.is_moe = moe_layer_pattern(cfg)[spec_layer]
        if self.is_moe:
            self.mlp = MoELayer(cfg, ps, layer_number=layer_number, seed=seed,
                                sequence_parallel=sequence_parallel)
        else:
            self.mlp = MLP(cfg, ps, recompute=cfg.recomputes("mlp"), **par)
        self.recompute_mlp = cfg.recomputes("mlp") and not self.is_moe
        self.recompute_norms = cfg.recomputes("layernorm")

    def _norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``, checkpointed under ``--recompute-modules layernorm`` in training."""
        if self.recompute_norms and self.training and torch.is_grad_enabled():
            return checkpoint(norm, x, use_reentrant=False)
        return norm(x)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        with self.rng.fork(self.dropout_stream):
            return F.dropout(x, self.hidden_dropout)

    def forward(self, x: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                document_ids: torch.Tensor | None = None,
                inference_cache=None) -> torch.Tensor:
        """``document_ids`` ``[b, s]`` (``--reset-attention-mask``): attend within documents.
        ``inference_cache``: an :class:`~megalite.inference.kv_cache.InferenceCache`
        (generation only; None in training)."""
        kv = None if inference_cache is None else inference_cache.layer(self.layer_number)
        x = x + self._dropout(self.self_attention(self._norm(self.input_layernorm, x),
                                                  rotary, document_ids, kv_cache=kv))
        return x + self._dropout(self.mlp(self._norm(self.pre_mlp_layernorm, x)))
