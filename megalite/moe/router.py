"""Top-k router: scores, expert choice, capacity, and the load-balancing / z losses.

Shapes: ``T`` tokens on this rank (``s_local * b``), ``E`` experts, ``k`` = topk.

Scores (``--moe-router-score-function``):

* ``softmax`` (Mixtral): top-k of the logits, then a softmax over the k chosen ones. This
  equals Mixtral's "softmax over all E, keep the top k, renormalize".
* ``sigmoid``: top-k of ``sigmoid(logits)``, renormalized to sum to one when k > 1.

Either is then multiplied by ``--moe-router-topk-scaling-factor`` when set.

Capacity (``--moe-expert-capacity-factor``, Megatron's definition, over this rank's T
tokens): ``capacity = ceil(T * k / E * factor)``. Each expert keeps at most ``capacity``
of the tokens routed to it: those with the highest probabilities (``probs``) or the
earliest ones (``position``); the others are dropped (probability 0, not sent). With
``--moe-pad-expert-input-to-capacity`` every expert receives exactly ``capacity`` tokens,
filled up with tokens of probability 0 (earliest first).

Losses, over the micro-batch's tokens on this rank's ``token_group`` (``ps.tp_cp``:
under sequence/context parallelism each rank holds a different slice of the same
sequences; the dispatcher scatters the sequence over tp when sequence parallelism is off):

* ``aux_loss``: ``E * coeff * sum_i f_i * P_i`` with ``f_i`` the fraction of the ``T*k``
  routing choices (before capacity drops) that picked expert i and ``P_i`` the mean
  score of expert i (softmax over all E, or sigmoid scores normalized per token).
* ``seq_aux_loss``: the same per sequence (``f`` and ``P`` over each sequence's tokens),
  averaged over the b sequences.
* ``z_loss``: ``coeff * mean_t logsumexp(logits_t)^2``.

The statistics are summed over ``token_group`` with an all-reduce whose backward is the
identity (``reduce_from_tensor_model_parallel_region``): every rank holds the full loss
value and back-propagates it into its own tokens only, so summing the router gradient over
tp (the router weight is ``sequence_parallel``) and cp (the dp_cp reduction) gives the
gradient of one copy of the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megalite.parallel import mappings
from megalite.parallel.params import mark_param


# -- pure routing math -------------------------------------------------------------------
def topk_probs(logits: torch.Tensor, k: int, score_function: str = "softmax",
               scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[T, E]`` (fp32) -> (probs ``[T, k]``, expert indices ``[T, k]``)."""
    if score_function == "softmax":
        top, idx = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(top, dim=-1)
    elif score_function == "sigmoid":
        top, idx = torch.topk(torch.sigmoid(logits), k, dim=-1)
        probs = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, idx


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per-token scores over all experts ``[T, E]`` that the load-balancing loss averages."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Megatron's capacity: ``ceil(num_tokens * topk / num_experts * factor)``, at most
    ``num_tokens`` (an expert cannot receive a token twice)."""
    return min(num_tokens, math.ceil(num_tokens * topk / num_experts * factor))


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                   drop_policy: str = "probs", pad_to_capacity: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert.

    ``probs`` ``[T, E]`` (0 where not routed), ``routing_map`` ``[T, E]`` bool. Returns the
    new (probs, routing_map). Ties (equal probabilities, or padding tokens) go to the
    earliest token, so the choice is deterministic.
    """
    if drop_policy == "probs":
        # rank tokens within each expert by (prob desc, position asc): a stable sort
        key = probs.detach()
    elif drop_policy == "position":
        key = routing_map.to(probs.dtype)
    else:
        raise ValueError(f"unknown token drop policy {drop_policy!r}")
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    keep = torch.zeros_like(routing_map).scatter_(0, order, True)
    new_map = keep if pad_to_capacity else keep & routing_map
    return probs * new_map, new_map


# -- loss plumbing -----------------------------------------------------------------------
class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``activation``; backward also sends ``scale`` into ``loss``.

    This is how the router losses reach the gradient without the caller adding them to
    the LM loss: ``d(total)/d(loss) = scale``, where the caller picks ``scale`` as the
    factor its LM loss was multiplied by (1/num_microbatches, the fp16 loss scale, ...).
    """

    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


@dataclass
class Routing:
    """What the router decided for this rank's ``T`` tokens.

    ``probs`` ``[T, E]`` fp32, 0 for experts a token does not go to; ``routing_map``
    ``[T, E]`` bool, which experts get each token (may include probability-0 padding);
    ``loss`` the scaled sum of aux and z losses (or None); ``values`` their detached
    values for logging (``moe_aux_loss``, ``moe_z_loss``).
    """

    probs: torch.Tensor
    routing_map: torch.Tensor
    loss: torch.Tensor | None
    values: dict


class TopKRouter(torch.nn.Module):
    """Gate ``[s, b, h]`` -> :class:`Routing` of its ``s * b`` tokens.

    Weight ``[E, h]``, replicated on every rank (``expert_parallel`` False). Logits and
    routing are computed in fp32. ``token_group`` (``ps.tp_cp``) is the group whose
    ranks hold different tokens of the same micro-batch; the loss statistics are summed
    over it (see the module docstring).
    """

    def __init__(self, cfg, ps, *, device=None, dtype=None):
        super().__init__()
        token_group = ps.tp_cp
        self.num_experts = cfg.num_experts
        self.topk = cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        self.balance = cfg.moe_router_load_balancing_type
        self.aux_coeff = cfg.moe_aux_loss_coeff or 0.0
        self.z_coeff = cfg.moe_z_loss_coeff or 0.0
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.drop_policy = cfg.moe_token_drop_policy
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity
        self.token_group = token_group
        # tokens are split over tp inside the MoE layer, so the router sees partial batches
        self.weight = mark_param(torch.nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype)),
            init_std=cfg.init_method_std, sequence_parallel=ps.tp.size > 1)

    def forward(self, hidden: torch.Tensor) -> Routing:
        s, b, h = hidden.shape
        logits = F.linear(hidden.reshape(s * b, h).float(), self.weight.float())  # [T, E]
        top, idx = topk_probs(logits, self.topk, self.score_function, self.scaling_factor)
        probs = torch.zeros_like(logits).scatter(1, idx, top)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        loss, values = None, {}
        if self.balance != "none" and self.aux_coeff > 0:
            aux = self._load_balancing_loss(logits, routing_map, s, b)
            loss, values["moe_aux_loss"] = aux, aux.detach()
        if self.z_coeff > 0:
            z = self._z_loss(logits)
            loss = z if loss is None else loss + z
            values["moe_z_loss"] = z.detach()
        if self.capacity_factor is not None:
            cap = expert_capacity(s * b, self.num_experts, self.topk, self.capacity_factor)
            probs, routing_map = apply_capacity(probs, routing_map, cap, self.drop_policy,
                                                self.pad_to_capacity)
        return Routing(probs, routing_map, loss, values)

    def _sum_over_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of per-rank partial sums over ``token_group``; backward is the identity."""
        return mappings.reduce_from_tensor_model_parallel_region(x, self.token_group)

    def _load_balancing_loss(self, logits, routing_map, s, b) -> torch.Tensor:
        E, k, n = self.num_experts, self.topk, self.token_group.size
        scores = scores_for_aux_loss(logits, self.score_function)
        counts = routing_map.to(torch.float32)
        if self.balance == "seq_aux_loss":  # statistics per sequence: [b, E]
            score_sum = scores.view(s, b, E).sum(0)
            counts = counts.view(s, b, E).sum(0)
            tokens, num_groups = s * n, b
        else:
            score_sum, counts = scores.sum(0), counts.sum(0)
            tokens, num_groups = s * b * n, 1
        # one all-reduce for both statistics; only the scores carry a gradient
        score_sum, counts = self._sum_over_tokens(
            torch.cat([score_sum, counts], dim=-1)).split(E, dim=-1)
        f = counts / (tokens * k)
        p = score_sum / tokens
        return (f * p).sum() * (E * self.aux_coeff / num_groups)

    def _z_loss(self, logits) -> torch.Tensor:
        total = self._sum_over_tokens(torch.logsumexp(logits, dim=-1).square().sum())
        return total * (self.z_coeff / (logits.shape[0] * self.token_group.size))
