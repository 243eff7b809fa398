"""Global gradient norm across model-parallel ranks, clipping, and inf/nan detection.

Gradients are read from ``param.main_grad`` (the fp32 accumulation buffer of
:class:`megalite.optim.data_parallel.DataParallelGrads`) when present, else ``param.grad``.
By the time these run, gradients are already summed over data parallel, so every dp rank
holds the same values and collectives only need the model-parallel group ``ps.mp``
(tensor x pipeline).

A parameter's gradient counts in the norm exactly once over the model:
tensor-parallel shards (``param.tensor_model_parallel``) count on every tp rank, replicated
parameters (norms, biases of row-parallel layers, ...) only on tp rank 0, and a word
embedding shared between the first and last pipeline stage (``param.shared_embedding``)
only on the first stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megalite.optim.comm import all_reduce
from megalite.parallel.state import Group, ParallelState


def param_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will use: ``main_grad`` if attached, else ``grad``."""
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


def counts_in_norm(param: torch.Tensor, ps: ParallelState) -> bool:
    """Whether this rank contributes ``param``'s gradient to the global norm."""
    if getattr(param, "shared_embedding", False) and not ps.is_pipeline_first_stage():
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or ps.tp.rank == 0


def global_grad_norm(params: Iterable[torch.Tensor], ps: ParallelState,
                     norm_type: float = 2.0) -> float:
    """L2 (or inf) norm of all gradients of the model, over the model-parallel group ps.mp.

    Returns a python float (inf/nan when a gradient is not finite).
    """
    grads = [param_grad(p) for p in params if counts_in_norm(p, ps)]
    grads = [g for g in grads if g is not None]
    device = grads[0].device if grads else ps.device
    if norm_type == math.inf:
        local = max((g.detach().abs().max().float() for g in grads),
                    default=torch.zeros((), device=device))
        total = all_reduce(local.reshape(1).clone(), ps.mp, dist.ReduceOp.MAX)
        return float(total.item())
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        local += g.detach().float().pow(2).sum()
    all_reduce(local, ps.mp)
    return float(local.sqrt().item())


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every gradient in place so the global norm is at most ``max_norm``.

    ``total_norm`` is the value from :func:`global_grad_norm` (identical on every rank, so
    no collective is needed here). Returns the factor applied (1.0 when within bounds).
    """
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    coeff = max_norm / (total_norm + 1e-6)
    if coeff >= 1.0:
        return 1.0
    for p in params:
        g = param_grad(p)
        if g is not None:
            g.mul_(coeff)
    return coeff


def found_non_finite(grads: Iterable[torch.Tensor | None], group: Group | None,
                     device: torch.device) -> bool:
    """True if any gradient on any rank of ``group`` holds an inf or nan.

    ``group`` None means the whole world (the default process group), so every rank
    agrees on whether the step is skipped.
    """
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        if g is not None and not torch.isfinite(g).all():
            flag.fill_(1.0)
            break
    return bool(all_reduce(flag, group, dist.ReduceOp.MAX).item() > 0)
