"""What every parallel piece needs to know about a parameter: one typed record per tensor.

Layers describe each parameter they create with :func:`mark_param`; everything that later
shards, reduces, initializes, clips or checkpoints a parameter reads that description with
:func:`param_meta` and nothing else. An unmarked parameter (a plain ``torch.nn.Parameter``
in a test or a user module) reads as replicated, dense, initialized elsewhere.

Fields of :class:`ParamMeta`:

``partition_dim``      the dimension sharded over tensor parallelism (``ps.tp``, or ``ps.etp``
                       for experts), -1 if replicated
``partition_parts``    part sizes along ``partition_dim`` in the *full* tensor, or None for
                       one part. Fused tensors (QKV = [Q; K; V], SwiGLU's [gate; up]) are split
                       part by part: rank r holds chunk r of every part, concatenated.
``unpadded_size``      full size along ``partition_dim`` before vocabulary padding, or None;
                       the layout-invariant full tensor drops the padding rows
``sequence_parallel``  replicated but fed sequence-sharded activations: the gradient is
                       partial and is summed over ``ps.tp`` before the data-parallel reduction
``shared_embedding``   the word embedding tied to the output layer (summed over
                       ``ps.embedding`` between the first and last pipeline stage)
``embedding_copy``     the output layer's copy of that word embedding (a later stage's, or
                       ZB-V's beside it on the first stage), or under a V schedule the
                       prediction depths' copy: not counted in the gradient norm, not saved
``expert``             one of an MoE layer's experts: stacked ``[E_local, ...]``, expert ``i``
                       of this rank is global expert ``first_expert + i`` (sharded over
                       ``ps.ep`` along dim 0, over ``ps.etp`` along ``partition_dim``);
                       gradients are reduced over ``ps.edp`` instead of ``ps.dp_cp``
``init_std`` / ``init_fill``  drawn from normal(0, init_std), or filled with a constant
``init_name``          the name the init seed is drawn from, when it differs from the
                       parameter's name in the module it is initialized from (a later
                       pipeline stage's tied output layer uses the word embedding's name; MoE
                       layers use ``layers.{i}.mlp.<name>``)
``initialized``        set once the layout-invariant initializer has drawn it, so a module
                       that initializes its own parameters (an MoE layer) is not drawn twice
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ATTR = "megalite_meta"


@dataclass
class ParamMeta:
    """How one parameter is sharded, reduced and initialized (see the module docstring)."""

    partition_dim: int = -1
    partition_parts: tuple[int, ...] | None = None
    unpadded_size: int | None = None
    sequence_parallel: bool = False
    shared_embedding: bool = False
    embedding_copy: bool = False
    expert: bool = False
    first_expert: int = 0
    init_std: float | None = None
    init_fill: float | None = None
    init_name: str | None = None
    initialized: bool = False

    @property
    def tensor_parallel(self) -> bool:
        """True when the tensor is sharded along ``partition_dim`` (over tp, or etp)."""
        return self.partition_dim >= 0


_DEFAULT = ParamMeta()


def mark_param(param: torch.nn.Parameter, *, partition_dim: int = -1,
               parts: Sequence[int] | None = None, unpadded_size: int | None = None,
               sequence_parallel: bool = False, init_std: float | None = None,
               init_fill: float | None = None, expert: bool = False,
               first_expert: int = 0) -> torch.nn.Parameter:
    """Attach a new :class:`ParamMeta` to ``param`` and return ``param``.

    Exactly one of ``init_std`` and ``init_fill`` must be given. ``sequence_parallel`` only
    applies to replicated tensors (a sharded tensor's gradient is complete on its rank).
    """
    if (init_std is None) == (init_fill is None):
        raise ValueError("give exactly one of init_std and init_fill")
    meta = ParamMeta(partition_dim=partition_dim,
                     partition_parts=tuple(parts) if parts is not None else None,
                     unpadded_size=unpadded_size,
                     sequence_parallel=sequence_parallel and partition_dim < 0,
                     expert=expert, first_expert=first_expert,
                     init_std=init_std, init_fill=init_fill)
    setattr(param, _ATTR, meta)
    return param


def param_meta(param: torch.Tensor) -> ParamMeta:
    """The :class:`ParamMeta` of ``param`` (a shared read-only default when unmarked)."""
    return getattr(param, _ATTR, _DEFAULT)


def update_meta(param: torch.Tensor, **changes) -> ParamMeta:
    """Change fields of ``param``'s record (marking it first with defaults if unmarked)."""
    meta = dataclasses.replace(param_meta(param), **changes)
    setattr(param, _ATTR, meta)
    return meta


def is_expert_param(param: torch.Tensor) -> bool:
    """Expert parameters are reduced over ``ps.edp`` and sharded over ``ps.ep``."""
    return param_meta(param).expert
