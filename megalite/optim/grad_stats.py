"""Statistics of the model for the log line: the parameters' L2 norm (``--log-params-norm``)
and the number of zero gradient elements (``--log-num-zeros-in-grad``).

Both count every logical element of the model once, whatever the layout, the way
:mod:`megalite.optim.clip_grads` computes the gradient norm: each rank passes the
``(param, values)`` pairs it owns after the data-parallel reduction (the optimizer's
:meth:`owned_grads` / :meth:`owned_params`: data-parallel rank 0's copies, or each rank's
disjoint shard under the distributed optimizer), :func:`counts_in_norm` drops the model-
parallel copies that another rank counts (replicated parameters off tp rank 0, the word
embedding's copy on the last pipeline stage), and one SUM over the world adds the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megalite.optim.clip_grads import counts_in_norm
from megalite.parallel.collectives import all_reduce
from megalite.parallel.state import ParallelState


def params_norm(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]],
                ps: ParallelState) -> float:
    """L2 norm of all parameters: ``sqrt(sum of squares)`` of the ``(param, values)`` pieces
    this rank owns (``values`` the fp32 master copy or a shard of it), fp64 SUM over the
    world. Every rank gets the same float."""
    local = torch.zeros(1, dtype=torch.float64, device=ps.device)
    for param, values in pieces:
        if counts_in_norm(param, ps) and values.numel():
            local += values.detach().double().pow(2).sum().to(local.device)
    all_reduce(local, None)
    return float(local.sqrt().item())


def num_zeros(pieces: Iterable[tuple[torch.Tensor, torch.Tensor]], ps: ParallelState) -> int:
    """Gradient elements equal to zero among the ``(param, grad)`` pieces this rank owns,
    int64 SUM over the world (every rank gets the same int)."""
    local = torch.zeros(1, dtype=torch.int64, device=ps.device)
    for param, grad in pieces:
        if grad is not None and counts_in_norm(param, ps):
            local += grad.numel() - torch.count_nonzero(grad).to(local.device)
    all_reduce(local, None)
    return int(local.item())
