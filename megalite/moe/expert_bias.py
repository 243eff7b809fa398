"""Aux-loss-free load balancing: the router's expert bias, updated once per optimizer step.

With ``--moe-router-enable-expert-bias`` every MoE layer's router holds ``expert_bias``
``[E]`` (added to the sigmoid scores for the choice of experts only) and counts in
``tokens_per_expert`` ``[E]`` the choices its rank's tokens made while gradients were
recorded (:class:`megalite.moe.router.TopKRouter`). A training step then:

1. :func:`reset_expert_load` before the first micro-batch's forward;
2. the forwards of every micro-batch add their counts (the router runs before dispatch,
   on this rank's own tokens, so ep moves no count);
3. :func:`update_expert_bias` after the optimizer step: the counts ``[L_local, E]`` of
   this rank's MoE layers are summed over ``ps.tp_cp`` and then ``ps.dp`` -- every rank
   of the pipeline stage, which between them hold each token of the global batch exactly
   once (the MoE layer splits the sequence over tp even without sequence parallelism) --
   and every rank applies ``bias += rate * sign(mean_e(count) - count)``. Counts are
   whole numbers in fp64, so the sums, and therefore the bias, are exactly the same for
   any layout, micro-batch split or number of ranks.

The update also returns each layer's load ratios (the most and least loaded expert's
count over the mean), summed over ``ps.pp`` so that every rank (the logging one
included) has every layer's: ``{global layer: (max / mean, min / mean)}``.
"""

from __future__ import annotations

import torch

from megalite.moe.layer import moe_layers
from megalite.parallel.collectives import all_reduce


def bias_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(global layer number, router) of every MoE layer of ``model`` (a module, or a list
    of pipeline chunks) whose router has an expert bias, by layer number."""
    out = []
    for chunk in ([model] if isinstance(model, torch.nn.Module) else model):
        for layer in moe_layers(chunk):
            if layer.router.expert_bias is not None:
                out.append((layer.layer_number, layer.router))
    return sorted(out, key=lambda item: item[0])


def reset_expert_load(model) -> None:
    """Zero every router's ``tokens_per_expert`` (before a step's first forward)."""
    for _, router in bias_routers(model):
        router.reset_load()


@torch.no_grad()
def bias_update(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The bias step of each layer: ``counts`` ``[L, E]`` (the global batch's) ->
    ``rate * sign(mean - count)`` ``[L, E]`` fp32 (0 for an expert at the mean)."""
    mean = counts.mean(-1, keepdim=True)
    return torch.sign(mean - counts).float() * rate


@torch.no_grad()
def update_expert_bias(model, ps, rate: float, num_layers: int
                       ) -> dict[int, tuple[float, float]]:
    """Sum the step's counts over the stage's ranks and move every bias (module
    docstring). Collective: an all-reduce over ``ps.tp_cp`` and ``ps.dp`` on the ranks
    that hold biased routers, then one over ``ps.pp`` on every rank (each must call it).
    Returns ``{global layer: (max / mean, min / mean)}`` of the biased MoE layers."""
    routers = bias_routers(model)
    table = torch.zeros(num_layers, 3, dtype=torch.float64, device=ps.device)
    if routers:
        counts = torch.stack([router.tokens_per_expert for _, router in routers])
        all_reduce(counts, ps.tp_cp)
        all_reduce(counts, ps.dp)
        steps = bias_update(counts, rate)
        for (_, router), step in zip(routers, steps):
            router.expert_bias.add_(step)
        mean = counts.mean(-1).clamp_min(1e-30)
        rows = torch.tensor([number for number, _ in routers], device=ps.device)
        table[rows, 0] = counts.max(-1).values / mean
        table[rows, 1] = counts.min(-1).values / mean
        table[rows, 2] = 1.0
    all_reduce(table, ps.pp)   # each layer lives on one stage
    return {layer: (float(table[layer, 0]), float(table[layer, 1]))
            for layer in range(num_layers) if table[layer, 2] > 0}


def load_metrics(ratios: dict[int, tuple[float, float]]) -> dict:
    """Log entries of :func:`update_expert_bias`'s ratios: ``moe_load_max_ratio`` /
    ``moe_load_min_ratio`` (the extremes over layers: the human line and TensorBoard) and
    ``expert_load`` ``{layer: [max / mean, min / mean]}`` (the metrics JSONL)."""
    if not ratios:
        return {}
    return {"moe_load_max_ratio": max(hi for hi, _ in ratios.values()),
            "moe_load_min_ratio": min(lo for _, lo in ratios.values()),
            "expert_load": {str(layer): [hi, lo] for layer, (hi, lo) in ratios.items()}}
