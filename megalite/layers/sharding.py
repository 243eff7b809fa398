"""How a parameter is split over tensor-parallel ranks, and layout-invariant init.

Every parameter of a megalite model carries these attributes (set by :func:`mark_param`):

``tensor_model_parallel``  bool, the tensor is sharded over the TP group
``partition_dim``          int, the sharded dimension (-1 if replicated)
``partition_parts``        tuple of part sizes along ``partition_dim`` in the *full* tensor,
                           or None for one part. Fused tensors (QKV = [Q; K; V], SwiGLU's
                           [gate; up]) are split part by part: rank r holds chunk r of every
                           part, concatenated, so each rank gets its own heads' q, k and v.
``unpadded_size``          full size along ``partition_dim`` before vocabulary padding, or
                           None; the layout-invariant full tensor drops the padding rows.
``sequence_parallel``      bool, replicated but fed sequence-sharded activations: the
                           gradient is partial and must be summed over TP
                           (:func:`megalite.parallel.grads.allreduce_sequence_parallel_grads`)
``shared_embedding``       bool, the word embedding when tied to the output layer
``init_std`` / ``init_fill``  normal(0, init_std) or a constant fill

The *full* tensor of a parameter is the same whatever the TP size; :func:`shard` cuts this
rank's piece out of it and :func:`unshard` reassembles it from every rank's piece.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from megalite.parallel.collectives import all_gather_list


def mark_param(param: torch.nn.Parameter, *, partition_dim: int = -1,
               parts: Sequence[int] | None = None, unpadded_size: int | None = None,
               sequence_parallel: bool = False, init_std: float | None = None,
               init_fill: float | None = None) -> torch.nn.Parameter:
    """Attach the sharding and init attributes described in the module docstring."""
    if (init_std is None) == (init_fill is None):
        raise ValueError("give exactly one of init_std and init_fill")
    param.tensor_model_parallel = partition_dim >= 0
    param.partition_dim = partition_dim
    param.partition_parts = tuple(parts) if parts is not None else None
    param.unpadded_size = unpadded_size
    param.sequence_parallel = sequence_parallel and partition_dim < 0
    param.shared_embedding = False
    param.init_std = init_std
    param.init_fill = init_fill
    return param


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """Shape of the layout-invariant full tensor of ``param``."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        dim = param.partition_dim
        shape[dim] = param.unpadded_size or shape[dim] * tp_size
    return tuple(shape)


def _part_sizes(param: torch.Tensor, full_size: int) -> tuple[int, ...]:
    return param.partition_parts or (full_size,)


def shard(full: torch.Tensor, param: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's piece of the full tensor ``full`` of ``param`` (same shape as ``param``)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    padded = param.shape[dim] * tp_size
    if param.unpadded_size and padded > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    pieces = [part.chunk(tp_size, dim=dim)[tp_rank]
              for part in full.split(_part_sizes(param, full.shape[dim]), dim=dim)]
    return torch.cat(pieces, dim=dim)


def unshard(pieces: Sequence[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """Reassemble the full tensor of ``param`` from every rank's piece (rank order)."""
    if not getattr(param, "tensor_model_parallel", False):
        return pieces[0]
    dim, tp_size = param.partition_dim, len(pieces)
    parts = _part_sizes(param, param.shape[dim] * tp_size)
    local_parts = [p // tp_size for p in parts]
    split = [piece.split(local_parts, dim=dim) for piece in pieces]
    full = torch.cat([torch.cat([s[i] for s in split], dim=dim) for i in range(len(parts))],
                     dim=dim)
    if param.unpadded_size:
        full = full.narrow(dim, 0, param.unpadded_size)
    return full


def gather_full(local: torch.Tensor, param: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather ``local`` (``param`` itself or its grad) over ``tp_group`` into the full
    tensor. Collective over ``tp_group`` for sharded params; replicated ones return as is."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    if tp_group.size == 1:
        return unshard([local], param)
    return unshard(all_gather_list(local, tp_group), param)


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that does not change between runs or processes."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def init_full_tensor(param: torch.Tensor, name: str, seed: int, tp_size: int) -> torch.Tensor:
    """The full fp32 CPU tensor of ``param``, drawn from (seed, name) only."""
    shape = full_shape(param, tp_size)
    if param.init_fill is not None:
        return torch.full(shape, float(param.init_fill))
    gen = torch.Generator().manual_seed(stable_seed(seed, name))
    return torch.empty(shape).normal_(0.0, param.init_std, generator=gen)


@torch.no_grad()
def initialize_params(module: torch.nn.Module, seed: int, tp_group) -> None:
    """Initialize every parameter of ``module`` from (seed, name) and keep this rank's
    shard. ``param.init_name`` overrides the name (a tied output weight on a later pipeline
    stage uses the embedding's name, so both copies start equal).

    Expert parameters (``param.expert_parallel``) are skipped: they hold this rank's
    slice of the experts, which only their MoE layer knows how to draw
    (``MoELayer.reset_parameters``)."""
    for name, param in module.named_parameters():
        if getattr(param, "expert_parallel", False):
            continue
        full = init_full_tensor(param, getattr(param, "init_name", name), seed, tp_group.size)
        param.copy_(shard(full, param, tp_group.size, tp_group.rank))
