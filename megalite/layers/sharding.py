"""How a parameter is split over tensor-parallel ranks, and layout-invariant init.

Each parameter's sharding and init are described by its
:class:`~megalite.parallel.params.ParamMeta` (set with :func:`mark_param`, read with
:func:`param_meta`). The *full* tensor of a parameter is the same whatever the layout;
:func:`shard` cuts this rank's piece out of it and :func:`unshard` reassembles it from every
rank's piece. :func:`initialize_params` draws every full tensor from (seed, name) and keeps
this rank's piece, so every layout builds the same model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from megalite.parallel.collectives import all_gather_list
from megalite.parallel.params import mark_param, param_meta, update_meta

__all__ = ["mark_param", "param_meta", "full_shape", "shard", "unshard", "gather_full",
           "stable_seed", "init_full_tensor", "initialize_params"]


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the layout-invariant full tensor of ``param`` over ``tp_size`` ranks
    (experts: of this rank's ``[E_local, ...]`` stack, unsharded over etp)."""
    meta, shape = param_meta(param), list(param.shape)
    if meta.tensor_parallel:
        dim = meta.partition_dim
        shape[dim] = meta.unpadded_size or shape[dim] * tp_size
    return tuple(shape)


def _part_sizes(param: torch.Tensor, full_size: int) -> tuple[int, ...]:
    return param_meta(param).partition_parts or (full_size,)


def shard(full: torch.Tensor, param: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's piece of the full tensor ``full`` of ``param`` (same shape as ``param``)."""
    meta = param_meta(param)
    if not meta.tensor_parallel:
        return full
    dim = meta.partition_dim
    padded = param.shape[dim] * tp_size
    if meta.unpadded_size and padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    pieces = [part.chunk(tp_size, dim=dim)[tp_rank]
              for part in full.split(_part_sizes(param, full.shape[dim]), dim=dim)]
    return torch.cat(pieces, dim=dim)


def unshard(pieces: Sequence[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Reassemble the full tensor of ``param`` from every rank's piece (rank order)."""
    meta = param_meta(param)
    if not meta.tensor_parallel:
        return pieces[0]
    dim, tp_size = meta.partition_dim, len(pieces)
    parts = _part_sizes(param, param.shape[dim] * tp_size)
    local_parts = [p // tp_size for p in parts]
    split = [piece.split(local_parts, dim=dim) for piece in pieces]
    full = torch.cat([torch.cat([s[i] for s in split], dim=dim) for i in range(len(parts))],
                     dim=dim)
    if meta.unpadded_size:
        full = full.narrow(dim, 0, meta.unpadded_size)
    return full


def gather_full(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """All-gather ``local`` (``param`` itself or its grad) over ``group`` (``ps.tp``, or
    ``ps.etp`` for experts) into the full tensor. Collective over ``group`` for sharded
    params; replicated ones return as is."""
    if not param_meta(param).tensor_parallel:
        return local
    if group.size == 1:
        return unshard([local], param)
    return unshard(all_gather_list(local, group), param)


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that does not change between runs or processes."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def init_full_tensor(param: torch.Tensor, name: str, seed: int, tp_size: int) -> torch.Tensor:
    """The full fp32 CPU tensor of a dense ``param``, drawn from (seed, name) only."""
    meta, shape = param_meta(param), full_shape(param, tp_size)
    if meta.init_fill is not None:
        return torch.full(shape, float(meta.init_fill))
    gen = torch.Generator().manual_seed(stable_seed(seed, name))
    return torch.empty(shape).normal_(0.0, meta.init_std, generator=gen)


def _init_expert_stack(param: torch.Tensor, name: str, seed: int, etp_size: int
                       ) -> torch.Tensor:
    """The ``[E_local, ...]`` stack of this rank's experts, unsharded over etp: each
    expert drawn from (seed, ``{name}.{global expert index}``), so the experts are the
    same whatever ep and etp, and a rank only draws the experts it holds."""
    meta, shape = param_meta(param), full_shape(param, etp_size)
    if meta.init_fill is not None:
        return torch.full(shape, float(meta.init_fill))
    experts = []
    for e in range(shape[0]):
        gen = torch.Generator().manual_seed(stable_seed(seed, f"{name}.{meta.first_expert + e}"))
        experts.append(torch.empty(shape[1:]).normal_(0.0, meta.init_std, generator=gen))
    return torch.stack(experts)


@torch.no_grad()
def initialize_params(module: torch.nn.Module, seed: int, ps, prefix: str | None = None
                      ) -> None:
    """Draw every not yet initialized parameter of ``module`` from (seed, name) and keep
    this rank's piece: dense tensors sharded over ``ps.tp``, experts over ``ps.etp`` (and
    ``ps.ep`` through their ``first_expert``).

    The name is ``meta.init_name`` when set, else ``{prefix}.{name}`` (or the name in
    ``module``); it is recorded as ``init_name``. Each parameter is drawn once: it is
    marked ``initialized`` afterwards and skipped by later calls (an MoE layer draws its
    own parameters when built; the model's pass then leaves them alone). A parameter on the
    ``meta`` device (the dry run) has no data: it gets its name, and nothing is drawn.
    """
    for name, param in module.named_parameters():
        meta = param_meta(param)
        if meta.initialized:
            continue
        init_name = meta.init_name or (f"{prefix}.{name}" if prefix else name)
        if param.is_meta:
            update_meta(param, init_name=init_name, initialized=True)
            continue
        group = ps.etp if meta.expert else ps.tp
        if meta.expert:
            full = _init_expert_stack(param, init_name, seed, group.size)
        else:
            full = init_full_tensor(param, init_name, seed, group.size)
        param.copy_(shard(full, param, group.size, group.rank))
        update_meta(param, init_name=init_name, initialized=True)
