"""Top-k router: scores, expert choice, capacity, the load-balancing / z losses and the
expert bias of aux-loss-free balancing.

Shapes: ``T`` tokens on this rank (``s_local * b``), ``E`` experts, ``k`` = topk.

Logits, scores and probabilities are fp32 (``--moe-router-dtype fp64``: fp64), whatever
the model's dtype. Scores (``--moe-router-score-function``):

* ``softmax`` (Mixtral): top-k of the logits, then a softmax over the k chosen ones. This
  equals Mixtral's "softmax over all E, keep the top k, renormalize".
  ``--moe-router-pre-softmax``: softmax over all E, then the top-k of those, not
  renormalized.
* ``sigmoid`` (DeepSeek-V3, Kimi-K2): top-k of ``sigmoid(logits)``, renormalized to sum
  to one when k > 1. With ``--moe-router-enable-expert-bias`` the experts are chosen by
  ``sigmoid(logits) + bias`` while the weights stay the unbiased scores of the chosen.

Either is then multiplied by ``--moe-router-topk-scaling-factor`` when set.

Group-limited routing (``--moe-router-num-groups G``, ``--moe-router-group-topk g``,
Megatron's definition): the E experts form G groups of E/G consecutive experts; a group's
score is the sum of its top ``k // g`` choice scores (biased where the bias applies; the
logits or pre-softmax scores under softmax); each token keeps its top g groups and chooses
its k experts among their experts only. DeepSeek-V3 (k 8, g 4) sums the top 2, as
``transformers``' ``DeepseekV3TopkRouter`` does.

Expert bias (``--moe-router-enable-expert-bias``): a buffer ``expert_bias`` ``[E]`` fp32,
saved in checkpoints like a replicated parameter. While gradients are recorded (training,
not a recomputation inside backward) the router adds the ``T * k`` choices of this rank's
tokens to ``tokens_per_expert`` ``[E]``; once per optimizer step
:mod:`megalite.moe.expert_bias` sums the counts of every micro-batch and rank of the
global batch and moves the bias by ``rate * sign(mean - count)``.

``--moe-router-force-load-balancing`` (benchmarks): the choice is made on random normal
logits drawn from the router's own generator (seeded by layer and rank), straight-through
to the real logits in backward, as Megatron does; the results then depend on the layout.

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
def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores`` ``[T, E]`` among the experts of each token's ``group_topk``
    best groups (see the module docstring) -> (values ``[T, k]``, indices ``[T, k]``)."""
    T, E = scores.shape
    per_group = E // num_groups
    group_scores = scores.view(T, num_groups, per_group).topk(
        k // group_topk, dim=-1).values.sum(-1)                         # [T, G]
    groups = group_scores.topk(group_topk, dim=-1).indices             # [T, g]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
    masked = scores.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    return torch.topk(masked, k, dim=-1)


def select_topk(scores: torch.Tensor, k: int, num_groups: int | None = None,
                group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) ``[T, k]`` of the top k of ``scores`` ``[T, E]``, group-limited
    when ``num_groups`` is set."""
    if num_groups:
        return group_limited_topk(scores, k, num_groups, group_topk)
    return torch.topk(scores, k, dim=-1)


def topk_probs(logits: torch.Tensor, k: int, score_function: str = "softmax",
               scaling_factor: float | None = None, *, pre_softmax: bool = False,
               num_groups: int | None = None, group_topk: int | None = None,
               expert_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[T, E]`` -> (probs ``[T, k]``, expert indices ``[T, k]``); see the
    module docstring. ``expert_bias`` ``[E]`` (sigmoid only) shifts the choice, not the
    probabilities."""
    def choose(scores):
        return select_topk(scores, k, num_groups, group_topk)

    if score_function == "softmax":
        if pre_softmax:
            probs, idx = choose(torch.softmax(logits, dim=-1))
        else:
            top, idx = choose(logits)
            probs = torch.softmax(top, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, idx = choose(scores + expert_bias.to(scores.dtype))
            top = scores.gather(1, idx)
        else:
            top, idx = choose(scores)
        probs = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if scaling_factor is not None:
        probs = probs * scaling_factor
    return probs, idx


class _RandomLogits(torch.autograd.Function):
    """Forward: ``random`` (same shape as ``logits``); backward: the gradient reaches
    ``logits`` unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, logits, random):
        return random

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


def counting() -> bool:
    """Whether a forward now counts towards the expert load: gradients are recorded and
    this is not the recomputation of a checkpointed layer inside backward (which would
    count the same tokens twice)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


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
    routing are computed in fp32 (or fp64). ``token_group`` (``ps.tp_cp``) is the group
    whose ranks hold different tokens of the same micro-batch; the loss statistics are
    summed over it (see the module docstring). With the expert bias: the buffers
    ``expert_bias`` ``[E]`` fp32 (persistent) and ``tokens_per_expert`` ``[E]`` fp64 (this
    rank's choices since the last :meth:`reset_load`). ``seed`` seeds the random logits
    of ``--moe-router-force-load-balancing`` (with the layer and the rank).
    """

    def __init__(self, cfg, ps, *, device=None, dtype=None, seed: int = 0):
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
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.num_groups = cfg.moe_router_num_groups
        self.group_topk = cfg.moe_router_group_topk
        self.dtype = torch.float64 if cfg.moe_router_dtype == "fp64" else torch.float32
        self.token_group = token_group
        bias = cfg.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(
            cfg.num_experts, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("tokens_per_expert", torch.zeros(
            cfg.num_experts, dtype=torch.float64, device=device) if bias else None,
            persistent=False)
        self.force_balance = cfg.moe_router_force_load_balancing
        self.random_seed = seed * 1_000_003 + ps.rank
        self.random = None   # the generator, made on the logits' device at first use
        # tokens are split over tp inside the MoE layer, so the router sees partial batches
        self.weight = mark_param(torch.nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, device=device, dtype=dtype)),
            init_std=cfg.init_method_std, sequence_parallel=ps.tp.size > 1)

    def forward(self, hidden: torch.Tensor) -> Routing:
        s, b, h = hidden.shape
        logits = F.linear(hidden.reshape(s * b, h).to(self.dtype),
                          self.weight.to(self.dtype))  # [T, E]
        choice_logits = logits
        if self.force_balance:
            if self.random is None or self.random.device != logits.device:
                self.random = torch.Generator(device=logits.device)
                self.random.manual_seed(self.random_seed)
            random = torch.randn(logits.shape, generator=self.random, dtype=logits.dtype,
                                 device=logits.device)
            choice_logits = _RandomLogits.apply(logits, random)
        top, idx = topk_probs(choice_logits, self.topk, self.score_function,
                              self.scaling_factor, pre_softmax=self.pre_softmax,
                              num_groups=self.num_groups, group_topk=self.group_topk,
                              expert_bias=self.expert_bias)
        probs = torch.zeros_like(logits).scatter(1, idx, top)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        if self.tokens_per_expert is not None and counting():
            self.tokens_per_expert += routing_map.sum(0, dtype=torch.float64)
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

    def _apply(self, fn, recurse=True):
        """``module.to(bf16)`` and the like keep the bias fp32 and the counts fp64."""
        super()._apply(fn, recurse)
        for name, dtype in (("expert_bias", torch.float32), ("tokens_per_expert",
                                                           torch.float64)):
            buf = self._buffers.get(name)
            if buf is not None and buf.dtype != dtype:
                self._buffers[name] = buf.to(dtype)
        return self

    @torch.no_grad()
    def reset_load(self) -> None:
        """Zero ``tokens_per_expert`` (the start of an optimizer step's forwards)."""
        if self.tokens_per_expert is not None:
            self.tokens_per_expert.zero_()

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
