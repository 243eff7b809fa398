"""In-place all-reduces on a :class:`~megalite.parallel.state.Group` or the whole world.

Both short-circuit when only one rank takes part (including a world that never initialized
torch.distributed), so callers need no ``if size > 1`` of their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.state import Group


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def all_reduce(tensor: torch.Tensor, group: Group | None = None,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (None: the default, world group)."""
    if group is None:
        if _world_size() > 1:
            dist.all_reduce(tensor, op=op)
    elif group.size > 1:
        dist.all_reduce(tensor, op=op, group=group.group)
    return tensor


def all_reduce_scalar(value: float, group: Group | None = None, op=dist.ReduceOp.SUM,
                      device: torch.device | None = None) -> float:
    """``value`` reduced over ``group`` (None: the world), as a python float (fp64 on the
    wire). ``device`` must be the rank's device under NCCL."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return float(all_reduce(t, group, op).item())
