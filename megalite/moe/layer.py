"""The mixture-of-experts layer that replaces the MLP of a transformer layer.

::

    mlp = MoELayer(model_cfg, pstate, layer_number=global_layer, seed=seed,
                   sequence_parallel=sp)
    out = mlp(hidden)      # [s, b, h] ([s/tp, b, h] under sequence parallelism), same dtype
    mlp.aux_losses         # {"moe_aux_loss": ..., "moe_z_loss": ...} of the last forward

Inside the layer the tokens are always split over tp: without sequence parallelism (and
tp > 1) the replicated input is scattered along the sequence on entry and all-gathered on
exit, so no two ranks route or compute the same token and the experts (etp = 1) never see
a token twice. Then: router -> dispatcher (alltoall / allgather over ``pstate.ep``) ->
local experts (grouped GEMM) -> weighted combine, plus the shared experts (a dense
tensor-parallel MLP of ``--moe-shared-expert-intermediate-size`` over every token).

Router losses. The aux (load-balancing) and z losses join the gradient through
:class:`megalite.moe.router.AttachAuxLoss` on the layer's output: identity forward, and in
backward d(loss) = ``aux_loss_scale``. The caller never adds them to the LM loss; it sets
the scale its LM loss carries, per layer object, with :meth:`MoELayer.set_aux_loss_scale`
or :func:`set_aux_loss_scale` over a whole model. With megalite's gradient reduction
(sums over data parallel) the mean of the per-micro-batch losses needs
``loss_scale / (num_microbatches * pstate.dp.size)`` (dp without cp: cp ranks hold
slices of the same micro-batch and share one loss). The default 1.0 suits one process
and one micro-batch; ``megalite.training.forward_backward`` sets it before every step
and collects the logged values per micro-batch (``RouterLosses``).

Initialization is layout invariant: every tensor is drawn from (seed, global name) and
sliced; names are ``layers.{layer_number}.mlp.router.weight``,
``layers.{layer_number}.mlp.experts.{fc1,fc2,fc1_bias,fc2_bias}.{global expert}``,
``layers.{layer_number}.mlp.shared_experts.{fc1,fc2}.{weight,bias}`` (also in
``param.init_name``). A generic initializer must skip ``param.expert_parallel``
parameters (they need the ep slice); :meth:`MoELayer.reset_parameters` redoes them all.
"""

from __future__ import annotations

import math

import torch

from megalite.config import ConfigError
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.layers.sharding import init_full_tensor, mark_param, shard
from megalite.moe.comm import CommCounter
from megalite.moe.dispatcher import DISPATCHERS
from megalite.moe.experts import GroupedMLP, activation
from megalite.moe.router import AttachAuxLoss, TopKRouter
from megalite.parallel import mappings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_moe_config(cfg, pstate) -> None:
    """Clear errors for MoE settings that cannot work on this layout."""
    if cfg.num_experts is None:
        raise ConfigError("MoELayer needs --num-experts")
    if cfg.moe_router_topk > cfg.num_experts:
        raise ConfigError(f"moe_router_topk ({cfg.moe_router_topk}) must be <= num_experts "
                          f"({cfg.num_experts})")
    if cfg.num_experts % pstate.ep.size:
        raise ConfigError(f"num_experts ({cfg.num_experts}) must be divisible by "
                          f"expert_model_parallel_size ({pstate.ep.size})")
    etp = pstate.etp.size
    if cfg.moe_ffn_hidden_size % etp:
        raise ConfigError(f"moe_ffn_hidden_size ({cfg.moe_ffn_hidden_size}) must be divisible "
                          f"by expert_tensor_parallel_size ({etp})")
    if cfg.add_bias_linear and etp > 1 and etp != pstate.tp.size:
        raise ConfigError(f"expert biases need expert_tensor_parallel_size ({etp}) equal to 1 "
                          f"or to tensor_model_parallel_size ({pstate.tp.size})")


class SharedExpertMLP(torch.nn.Module):
    """Dense MLP over every token, tensor parallel over ``pstate.tp``.

    ``[s/tp, b, h]`` -> ``[s/tp, b, h]`` when tp > 1 (sequence parallel: all-gather before
    fc1, reduce-scatter after fc2, over tp); ``[s, b, h]`` at tp = 1. fc1 ``[f1/tp, h]``
    (SwiGLU: gate | up parts), fc2 ``[h, ffn/tp]``.
    """

    def __init__(self, cfg, ffn: int, tp_group, *, device=None, dtype=None):
        super().__init__()
        sp = tp_group.size > 1
        self.swiglu = cfg.swiglu
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = {"tp_group": tp_group, "bias": cfg.add_bias_linear, "sequence_parallel": sp,
              "device": device, "dtype": dtype}
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, (2 if cfg.swiglu else 1) * ffn,
                                        init_std=cfg.init_method_std,
                                        parts=(ffn, ffn) if cfg.swiglu else None, **kw)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, init_std=out_std, **kw)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(hidden), self.swiglu))


class MoELayer(torch.nn.Module):
    """Router + token dispatcher + grouped experts (+ shared experts); see module doc."""

    def __init__(self, cfg, pstate, layer_number: int, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        check_moe_config(cfg, pstate)
        self.pstate = pstate
        self.layer_number = layer_number
        self.seed = seed
        self.sequence_parallel = sequence_parallel and pstate.tp.size > 1
        kw = {"device": pstate.device, "dtype": _DTYPES[cfg.params_dtype_name]}
        self.router = TopKRouter(cfg, pstate.tp_cp, **kw)
        # tokens are split over tp inside the layer, so the router sees partial batches
        mark_param(self.router.weight, init_std=cfg.init_method_std,
                   sequence_parallel=pstate.tp.size > 1)
        self.router.weight.expert_parallel = False
        num_local = cfg.num_experts // pstate.ep.size
        self.dispatcher = DISPATCHERS[cfg.moe_token_dispatcher_type](
            cfg.num_experts, pstate, CommCounter())
        self.experts = GroupedMLP(cfg, num_local, self.dispatcher.first_expert, pstate.etp,
                                  **kw)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(
                cfg, cfg.moe_shared_expert_intermediate_size, pstate.tp, **kw)
            for p in self.shared_experts.parameters():
                p.expert_parallel = False
        self.aux_loss_scale = 1.0
        self.aux_losses: dict = {}
        self.reset_parameters()

    def set_aux_loss_scale(self, scale: float) -> None:
        """Gradient factor of the router losses (see the module docstring)."""
        self.aux_loss_scale = float(scale)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw every parameter from (seed, global name); see the module docstring."""
        prefix = f"layers.{self.layer_number}.mlp"
        tp = self.pstate.tp
        self.router.weight.init_name = f"{prefix}.router.weight"
        self.router.weight.copy_(init_full_tensor(self.router.weight,
                                                  self.router.weight.init_name, self.seed, 1))
        self.experts.reset_parameters(self.seed, f"{prefix}.experts")
        if self.shared_experts is not None:
            for name, p in self.shared_experts.named_parameters():
                p.init_name = f"{prefix}.shared_experts.{name}"
                p.copy_(shard(init_full_tensor(p, p.init_name, self.seed, tp.size), p,
                              tp.size, tp.rank))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape."""
        tp, dtype = self.pstate.tp, hidden.dtype
        scatter = tp.size > 1 and not self.sequence_parallel
        if scatter:
            if hidden.shape[0] % tp.size:
                raise ValueError(f"MoE without sequence parallelism splits the sequence "
                                 f"({hidden.shape[0]}) over tp ({tp.size}): not divisible")
            hidden = mappings.scatter_to_sequence_parallel_region(hidden, tp)
        s, b, h = hidden.shape
        routing = self.router(hidden)
        out = self.dispatcher(hidden.reshape(s * b, h), routing.probs, routing.routing_map,
                              self.experts).view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        if routing.loss is not None and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, routing.loss, self.aux_loss_scale)
        self.aux_losses = routing.values
        if scatter:
            out = mappings.gather_from_sequence_parallel_region(
                out, tp, tensor_parallel_output_grad=False)
        return out.to(dtype)


def moe_layer_pattern(cfg) -> list[bool]:
    """Which of the ``num_layers`` layers (0-based, global) are MoE layers: every
    ``--moe-layer-freq``-th one starting with layer 0 (all of them by default)."""
    if cfg.num_experts is None:
        return [False] * cfg.num_layers
    return [i % cfg.moe_layer_freq == 0 for i in range(cfg.num_layers)]


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(model: torch.nn.Module, scale: float) -> None:
    """Set the router-loss gradient factor on every MoE layer of ``model``."""
    for layer in moe_layers(model):
        layer.set_aux_loss_scale(scale)


def aux_loss_summary(model: torch.nn.Module) -> dict:
    """Mean over this rank's MoE layers of their last forward's ``aux_losses`` (floats).

    Averaging over pipeline stages and micro-batches is the training loop's job."""
    sums: dict = {}
    layers = moe_layers(model)
    for layer in layers:
        for name, value in layer.aux_losses.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return {name: total / len(layers) for name, total in sums.items()}
