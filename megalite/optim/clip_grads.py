"""Global gradient norm across all ranks, clipping, and inf/nan detection.

Gradients are read from ``param.main_grad`` (the accumulation buffer of
:class:`megalite.optim.data_parallel.DataParallelGrads`) when present, else ``param.grad``.

Each rank adds the squares of the gradient elements it *owns* and one SUM over the world
(= data parallel x model parallel) gives the norm, so every element counts exactly once:

- model parallel: tensor-parallel shards (``param_meta(p).tensor_parallel``) count on every
  tp rank, replicated parameters (norms, biases of row-parallel layers, ...) on tp rank 0
  only (expert-tp rank 0 for expert parameters), and a word embedding shared between the
  first and last pipeline stage (``param_meta(p).shared_embedding``) on the first stage only
  (under ZB-V's V placement both are on the first stage: the word embedding counts, the
  output chunk's copy, ``param_meta(p).embedding_copy``, the tied output layer's or the
  prediction depths' ``mtp_embedding``, does not);
- data parallel: after the data-parallel reduction every replica holds the same gradient,
  so :func:`global_grad_norm` counts it on data-parallel rank 0 only (``ps.dp_cp``, or
  ``ps.edp`` for expert parameters), while the distributed optimizer passes each rank's
  disjoint shard to :func:`sharded_grad_norm`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from megalite.parallel.params import is_expert_param, param_meta
from megalite.parallel.collectives import ReduceOp, all_reduce
from megalite.parallel.state import Group, ParallelState


def param_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will use: ``main_grad`` if attached, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def counts_in_norm(param: torch.Tensor, ps: ParallelState) -> bool:
    """Whether this rank's copy of ``param`` counts in the norm across model parallelism."""
    meta = param_meta(param)
    # a copy of the word embedding: on a later stage (the output layer's, or the one the
    # prediction depths look up), or (ZB-V) the output layer's beside it on the first stage
    if meta.shared_embedding and (not ps.is_pipeline_first_stage() or meta.embedding_copy):
        return False
    tp_rank = ps.etp.rank if is_expert_param(param) else ps.tp.rank
    return param_meta(param).tensor_parallel or tp_rank == 0


def first_replica(param: torch.Tensor, ps: ParallelState) -> bool:
    """Whether this rank is the data-parallel replica that counts ``param`` once its
    gradient is reduced: rank 0 of ``ps.dp_cp`` (``ps.edp`` for expert parameters)."""
    return (ps.edp if is_expert_param(param) else ps.dp_cp).rank == 0


def global_grad_norm(params: Iterable[torch.Tensor], ps: ParallelState,
                     norm_type: float = 2.0) -> float:
    """L2 (or inf) norm of all gradients of the model after the data-parallel reduction
    (replicated over data parallel); SUM (MAX) over the world.

    Returns a python float (inf/nan when a gradient is not finite).
    """
    grads = [param_grad(p) for p in params if counts_in_norm(p, ps) and first_replica(p, ps)]
    return _world_norm([g for g in grads if g is not None], ps, norm_type)


def sharded_grad_norm(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], ps: ParallelState,
                      norm_type: float = 2.0) -> float:
    """Norm over ``(param, grad_piece)`` pairs where the pieces of all data-parallel ranks
    partition the gradients (distributed optimizer); SUM (MAX) over the world."""
    return _world_norm([g for p, g in pieces if counts_in_norm(p, ps)], ps, norm_type)


def _world_norm(grads: list, ps: ParallelState, norm_type: float) -> float:
    device = grads[0].device if grads else ps.device
    if norm_type == math.inf:
        local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                    default=torch.zeros((), device=device))
        total = all_reduce(local.reshape(1).clone(), None, ReduceOp.MAX)
        return float(total.item())
    local = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        local += g.detach().float().pow(2).sum().double()
    all_reduce(local, None)
    return float(local.sqrt().item())


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """Factor that brings ``total_norm`` down to ``max_norm`` (1.0 when within bounds, when
    clipping is off, or when the norm is not finite)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every gradient in place so the global norm is at most ``max_norm``.

    ``total_norm`` is the value from :func:`global_grad_norm` (identical on every rank, so
    no collective is needed here). Returns the factor applied (1.0 when within bounds).
    """
    coeff = clip_coefficient(max_norm, total_norm)
    if coeff < 1.0:
        for p in params:
            g = param_grad(p)
            if g is not None:
                g.mul_(coeff)
    return coeff


def found_non_finite(grads: Iterable[torch.Tensor | None], group: Group | None,
                     device: torch.device, inv_scale: float = 1.0) -> bool:
    """True if any gradient on any rank of ``group`` holds an inf or nan; the gradients
    are multiplied by ``inv_scale`` (the loss scale's inverse) in the same pass.

    One multi-tensor kernel per device (torch's AMP unscale-and-check, which sets a flag
    on the device) and one host read, after the MAX over ``group``: no host sync per
    gradient, which on a GPU would leave it idle between ~150 small kernels a step.
    ``group`` None means the whole world (the default process group), so every rank
    agrees on whether the step is skipped.
    """
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g is not None and g.numel():
            by_device.setdefault(g.device, []).append(g)
    for where, tensors in by_device.items():
        found = flag if where == flag.device else torch.zeros(1, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, found, torch.full((1,), inv_scale, device=where))
        if found is not flag:
            flag = torch.maximum(flag, found.to(flag.device))
    return bool(all_reduce(flag, group, ReduceOp.MAX).item() > 0)
