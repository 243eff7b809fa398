"""The mixture-of-experts layer that replaces the MLP of a transformer layer.

::

    mlp = MoELayer(model_cfg, ps, layer_number=global_layer, seed=seed,
                   sequence_parallel=sp)
    out = mlp(hidden)      # [s, b, h] ([s/tp, b, h] under sequence parallelism), same dtype
    mlp.aux_losses         # {"moe_aux_loss": ..., "moe_z_loss": ...} of the last forward

Inside the layer the tokens are always split over tp: without sequence parallelism (and
tp > 1) the replicated input is scattered along the sequence on entry and all-gathered on
exit, so no two ranks route or compute the same token and the experts (etp = 1) never see
a token twice. Without gradients (generation, evaluation) a sequence that tp does not
divide -- a decoding step's one token -- is padded with zero tokens to a multiple of tp
before the scatter and cut back after the gather. The padding is routed like any token:
it can take expert capacity under ``--moe-expert-capacity-factor`` (which counts this
rank's tokens, so it differs across tp anyway) and joins that forward's logged router
losses; dropless, no real token's output depends on it. Training (the sequence divisible
by tp) never pads. Then: router -> dispatcher (alltoall / allgather over ``ps.ep``) ->
local experts (grouped GEMM) -> weighted combine, plus the shared experts (a dense
tensor-parallel MLP of ``--moe-shared-expert-intermediate-size`` over every token).
The shared experts run after the routed ones; under ``--moe-shared-expert-overlap`` (the
alltoall dispatcher at ep > 1) they run while the dispatch all-to-all is in flight, with the
same results (:mod:`megalite.moe.shared_overlap`).

Router losses. The aux (load-balancing) and z losses join the gradient through
:class:`megalite.moe.router.AttachAuxLoss` on the layer's output: identity forward, and in
backward d(loss) = ``aux_loss_scale``. The caller never adds them to the LM loss; it sets
the scale its LM loss carries, per layer object, with :meth:`MoELayer.set_aux_loss_scale`
or :func:`set_aux_loss_scale` over a whole model. With megalite's gradient reduction
(sums over data parallel) the mean of the per-micro-batch losses needs
``loss_scale / (num_microbatches * ps.dp.size)`` (dp without cp: cp ranks hold
slices of the same micro-batch and share one loss). The default 1.0 suits one process
and one micro-batch; ``megalite.training.forward_backward`` sets it before every step
and collects the logged values per micro-batch (``RouterLosses``).

Initialization is layout invariant: every tensor is drawn from (seed, global name) and
sliced, when the layer is built (``layers.sharding.initialize_params``, which marks them
initialized so the model's own pass does not draw them again); names are
``layers.{layer_number}.mlp.router.weight``,
``layers.{layer_number}.mlp.experts.{fc1,fc2,fc1_bias,fc2_bias}.{global expert}``,
``layers.{layer_number}.mlp.shared_experts.{fc1,fc2}.{weight,bias}`` (the parameter's
``init_name``). :meth:`MoELayer.reset_parameters` redraws them all.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from megalite.config import ConfigError
from megalite.layers.fp8 import Fp8Recipe
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.layers.sharding import initialize_params
from megalite.moe.comm import CommCounter
from megalite.moe.dispatcher import DISPATCHERS
from megalite.moe.experts import GroupedMLP, activation
from megalite.moe.router import AttachAuxLoss, TopKRouter
from megalite.moe.shared_overlap import SideJob
from megalite.parallel import mappings
from megalite.parallel.params import update_meta

class SharedExpertMLP(torch.nn.Module):
    """Dense MLP over every token, tensor parallel over ``ps.tp``.

    ``[s/tp, b, h]`` -> ``[s/tp, b, h]`` when tp > 1 (sequence parallel: all-gather before
    fc1, reduce-scatter after fc2, over tp); ``[s, b, h]`` at tp = 1. fc1 ``[f1/tp, h]``
    (SwiGLU: gate | up parts), fc2 ``[h, ffn/tp]``.
    """

    def __init__(self, cfg, ffn: int, ps, *, fp8=None, device=None, dtype=None):
        super().__init__()
        sp = ps.tp.size > 1
        self.swiglu = cfg.swiglu
        out_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        kw = {"ps": ps, "bias": cfg.add_bias_linear, "sequence_parallel": sp,
              "device": device, "dtype": dtype, "fp8": fp8}
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, (2 if cfg.swiglu else 1) * ffn,
                                        init_std=cfg.init_method_std,
                                        parts=(ffn, ffn) if cfg.swiglu else None, **kw)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, init_std=out_std, **kw)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(hidden), self.swiglu))


class MoELayer(torch.nn.Module):
    """Router + token dispatcher + grouped experts (+ shared experts); see module doc."""

    def __init__(self, cfg, ps, layer_number: int, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        if cfg.num_experts is None:
            raise ConfigError("MoELayer needs --num-experts")
        cfg.check_layout(ps.tp.size, ps.cp.size, ps.ep.size, ps.etp.size)
        self.ps = ps
        self.layer_number = layer_number
        self.seed = seed
        self.sequence_parallel = sequence_parallel and ps.tp.size > 1
        kw = {"device": ps.device, "dtype": cfg.params_dtype}
        self.router = TopKRouter(cfg, ps, seed=seed * 1000 + layer_number, **kw)
        num_local = cfg.num_experts // ps.ep.size
        self.dispatcher = DISPATCHERS[cfg.moe_token_dispatcher_type](
            cfg.num_experts, ps, CommCounter())
        fp8 = Fp8Recipe.for_layer(cfg, layer_number)
        self.experts = GroupedMLP(cfg, num_local, self.dispatcher.first_expert, ps, fp8=fp8,
                                  **kw)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(   # fp8 GEMMs as the dense MLP's
                cfg, cfg.moe_shared_expert_intermediate_size, ps, fp8=fp8, **kw)
        self.shared_overlap = (self.shared_experts is not None
                               and cfg.moe_shared_expert_overlap)
        self.recompute = cfg.recomputes("moe")
        self.aux_loss_scale = 1.0
        self.aux_losses: dict = {}
        self.reset_parameters()

    def set_aux_loss_scale(self, scale: float) -> None:
        """Gradient factor of the router losses (see the module docstring)."""
        self.aux_loss_scale = float(scale)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)draw every parameter from (seed, global name); see the module docstring."""
        for p in self.parameters():
            update_meta(p, initialized=False, init_name=None)
        initialize_params(self, self.seed, self.ps, prefix=f"layers.{self.layer_number}.mlp")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same shape."""
        tp, dtype = self.ps.tp, hidden.dtype
        scatter = tp.size > 1 and not self.sequence_parallel
        seq, pad = hidden.shape[0], 0
        if scatter:
            if seq % tp.size:
                if torch.is_grad_enabled():
                    raise ValueError(f"MoE without sequence parallelism splits the sequence "
                                     f"({seq}) over tp ({tp.size}): not divisible")
                pad = tp.size - seq % tp.size  # inference: zero tokens, dropped below
                hidden = torch.cat([hidden, hidden.new_zeros(pad, *hidden.shape[1:])])
            hidden = mappings.scatter_to_sequence_parallel_region(hidden, tp)
        routing = self.router(hidden)
        if self.recompute and self.training and torch.is_grad_enabled():
            out = checkpoint(self._experts, hidden, routing.probs, routing.routing_map,
                             use_reentrant=False)
        else:
            out = self._experts(hidden, routing.probs, routing.routing_map)
        if routing.loss is not None and torch.is_grad_enabled():
            out = AttachAuxLoss.apply(out, routing.loss, self.aux_loss_scale)
        self.aux_losses = routing.values
        if scatter:
            out = mappings.gather_from_sequence_parallel_region(
                out, tp, tensor_parallel_output_grad=False)
            if pad:
                out = out[:seq]
        return out.to(dtype)


    def _experts(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> torch.Tensor:
        """Dispatch, routed experts, combine, plus the shared experts: ``hidden`` ``[s, b,
        h]``, ``probs`` / ``routing_map`` ``[s*b, E]`` -> ``[s, b, h]``. The part
        ``--recompute-modules moe`` checkpoints (its collectives over ``ps.ep`` /
        ``ps.etp`` run again in backward); the router stays outside, so its losses,
        expert-load counts and random logits are computed once. Under
        ``--moe-shared-expert-overlap`` the shared experts run inside the dispatch
        all-to-all (:mod:`megalite.moe.shared_overlap`)."""
        s, b, h = hidden.shape
        job = None
        if self.shared_overlap:
            job = SideJob(lambda: self.shared_experts(hidden))
        out = self.dispatcher(hidden.reshape(s * b, h), probs, routing_map,
                              self.experts, side=job).view(s, b, h)
        if job is not None:
            out = out + job.take()
        elif self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


def moe_layer_pattern(cfg) -> list[bool]:
    """Which of the ``num_layers`` layers (0-based, global) are MoE layers: every
    ``--moe-layer-freq``-th one starting with layer 0 (all of them by default), or the
    0/1 per layer of its list form (``ModelConfig.moe_layer_pattern``)."""
    return list(cfg.moe_layer_pattern)


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(model: torch.nn.Module, scale: float) -> None:
    """Set the router-loss gradient factor on every MoE layer of ``model``."""
    for layer in moe_layers(model):
        layer.set_aux_loss_scale(scale)
