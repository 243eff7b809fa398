"""Where each rank's parameter shards sit in the layout-independent global tensors.

A checkpoint stores every parameter as one or more *global* tensors that do not depend on
the parallel layout; each rank writes (and later reads) the block it holds:

* Keys are parameter names without any pipeline-chunk prefix (layer numbers are global
  already): ``decoder.layers.3.mlp.linear_fc2.weight``.
* Tensor-parallel shards are blocks along ``partition_dim`` of the full tensor.
* Fused tensors (``partition_parts``: QKV, SwiGLU gate|up) are stored part by part, as
  ``<name>/part0``, ``<name>/part1`` ...: a rank's piece of a fused tensor is one block
  of *each* part, not one block of the concatenation.
* Vocabulary-padded tensors (``unpadded_size``) store only the real rows, so tp=1 and
  tp=4 agree; a rank whose block lies entirely in the padding holds nothing.
Each parameter's :class:`~megalite.parallel.params.ParamMeta` says which of these apply.

* Expert parameters (``expert``) are stacked ``[E_local, ...]`` per expert-parallel
  rank and stored as ``[E, ...]``; their tensor-parallel group is ``ps.etp``.
* The tied output layer of a later pipeline stage (``shared_embedding`` with
  ``init_name`` = the word embedding) is a copy of the word embedding: it is never saved
  and is loaded from ``embedding.word_embeddings.weight``; so is the prediction depths'
  copy under a V schedule (``mtp_embedding``, beside the embedding on pipeline rank 0).
  (Without a V schedule the depths' copy on the last stage has the embedding's own name
  and is stored under the embedding's key.)

:func:`param_layouts` computes this for a model (a module or a list of pipeline chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.layers.sharding import full_shape
from megalite.parallel.params import param_meta
from megalite.pipeline.layout import model_chunks

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Piece:
    """This rank's block of one global tensor.

    key:          global tensor name (``<param key>`` or ``<param key>/part<i>``)
    global_shape: shape of the global tensor
    offsets:      where the block starts in the global tensor
    sizes:        shape of the block
    local_dim / local_start: the block is ``local.narrow(local_dim, local_start,
                  sizes[local_dim])`` of the rank's local tensor (local_dim None: all of it)
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_dim: int | None = None
    local_start: int = 0

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The block of ``local`` (a parameter or a tensor of the same shape)."""
        if self.local_dim is None:
            return local
        return local.narrow(self.local_dim, self.local_start, self.sizes[self.local_dim])


@dataclass
class ParamLayout:
    """One parameter of this rank: its names, layout-free key, and pieces.

    ``name`` is the model's ``named_parameters()`` name (``0.decoder...`` for a ModuleList
    of chunks), ``local_name`` the name within its chunk (the optimizer's key). ``saved``
    is False for the tied output-layer copy (loaded from the embedding's key). ``mirror``:
    the tied copy on the rank that holds the word embedding too (ZB-V's V placement puts
    both on pipeline rank 0), the embedding's ``local_name``: neither saved nor read, it
    takes the embedding's loaded values (:func:`fill_mirrors`).
    """

    name: str
    local_name: str
    key: str
    param: torch.nn.Parameter
    pieces: list[Piece]
    global_shape: tuple[int, ...]   # the full (unpadded, all experts) tensor
    saved: bool = True
    mirror: str | None = None


def state_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters, then its persistent buffers (the routers' expert bias:
    state that is not trained by the optimizer but must be saved), by name."""
    params = list(module.named_parameters())
    names = {name for name, _ in params}
    buffers = [(name, t) for name, t in module.state_dict(keep_vars=True).items()
               if name not in names and not isinstance(t, torch.nn.Parameter)]
    return params + buffers


def named_parameters(model) -> list[tuple[str, str, torch.Tensor]]:
    """(model name, layout-free key, tensor) of every parameter and persistent buffer of
    ``model`` (buffers are replicated: every rank holding one stores the whole tensor).

    The model name is what ``model.named_parameters()`` says (``0.decoder...`` for a
    ModuleList of chunks); the key drops the chunk index.
    """
    chunks = model_chunks(model)
    out = []
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 or chunk is not model else ""
        for name, param in state_tensors(chunk):
            out.append((prefix + name, name, param))
    return out


def _groups(param, ps):
    """(tp size, tp rank, ep size, ep rank) that shard ``param``."""
    if param_meta(param).expert:
        return ps.etp.size, ps.etp.rank, ps.ep.size, ps.ep.rank
    return ps.tp.size, ps.tp.rank, 1, 0


def param_pieces(key: str, param: torch.Tensor, tp_size: int, tp_rank: int,
                 ep_size: int = 1, ep_rank: int = 0) -> list[Piece]:
    """The pieces of ``param`` (a local shard carrying the ``layers.sharding``
    attributes) on tensor-parallel rank ``tp_rank`` and expert-parallel rank ``ep_rank``."""
    meta = param_meta(param)
    local = tuple(param.shape)
    base = list(local)
    base_offsets = [0] * len(local)
    if ep_size > 1:
        base[0] = local[0] * ep_size
        base_offsets[0] = local[0] * ep_rank
    if not meta.tensor_parallel:
        return [Piece(key, tuple(base), tuple(base_offsets), local)]
    dim = meta.partition_dim
    if meta.partition_parts:
        pieces, start = [], 0
        for i, part in enumerate(meta.partition_parts):
            size = part // tp_size
            shape, offsets, sizes = list(base), list(base_offsets), list(local)
            shape[dim], offsets[dim], sizes[dim] = part, tp_rank * size, size
            pieces.append(Piece(f"{key}/part{i}", tuple(shape), tuple(offsets), tuple(sizes),
                                dim, start))
            start += size
        return pieces
    rows = local[dim]
    full = meta.unpadded_size or rows * tp_size
    first = tp_rank * rows
    count = max(0, min(rows, full - first))
    if count == 0:  # this rank's block is all vocabulary padding
        return []
    shape, offsets, sizes = list(base), list(base_offsets), list(local)
    shape[dim], offsets[dim], sizes[dim] = full, first, count
    return [Piece(key, tuple(shape), tuple(offsets), tuple(sizes), dim, 0)]


def global_shape(param, tp_size: int, ep_size: int = 1) -> tuple[int, ...]:
    """Shape of the full tensor of ``param``: all experts, all tp shards, no padding."""
    shape = list(full_shape(param, tp_size))
    if ep_size > 1:
        shape[0] *= ep_size
    return tuple(shape)


def is_tied_copy(param) -> bool:
    """The output layer's copy of the word embedding (a later pipeline stage's, or ZB-V's
    beside the embedding on the first stage), or under a V schedule the prediction depths'
    (``mtp_embedding``): ``param_meta(p).embedding_copy``."""
    return param_meta(param).embedding_copy


def param_layouts(model, ps) -> list[ParamLayout]:
    """Every parameter of ``model`` on this rank of ``ps`` (see module docstring)."""
    layouts, seen = [], set()
    named = list(named_parameters(model))
    embedding = next((local for _, local, _ in named if local == EMBEDDING_WEIGHT), None)
    for name, local_name, param in named:
        key, saved, mirror = local_name, True, None
        if is_tied_copy(param):
            key, saved, mirror = EMBEDDING_WEIGHT, False, embedding
        if key in seen and mirror is None:   # a mirror shares the embedding's key
            raise ValueError(f"two parameters of this rank map to checkpoint key {key!r}")
        seen.add(key)
        tp_size, tp_rank, ep_size, ep_rank = _groups(param, ps)
        pieces = param_pieces(key, param, tp_size, tp_rank, ep_size, ep_rank)
        layouts.append(ParamLayout(name, local_name, key, param, pieces,
                                   global_shape(param, tp_size, ep_size), saved, mirror))
    return layouts


def fill_mirrors(layouts: list[ParamLayout], per_param: dict | None) -> None:
    """Give each ``mirror`` layout its embedding's loaded values: the parameter and, in
    ``per_param`` (the optimizer's per-parameter state by ``local_name``, or None), a copy
    of the embedding's state."""
    by_name = {layout.local_name: layout for layout in layouts}
    for layout in layouts:
        if layout.mirror is None:
            continue
        with torch.no_grad():
            layout.param.copy_(by_name[layout.mirror].param)
        if per_param is not None and layout.mirror in per_param:
            per_param[layout.local_name] = {k: v.clone()
                                            for k, v in per_param[layout.mirror].items()}


def piece_keys(layout: ParamLayout) -> list[str]:
    """The global tensor keys of ``layout``'s parameter, whether or not this rank holds a
    block of them (a vocabulary shard that is all padding holds none)."""
    meta = param_meta(layout.param)
    parts = meta.partition_parts
    if meta.tensor_parallel and parts:
        return [f"{layout.key}/part{i}" for i in range(len(parts))]
    return [layout.key]


def read_fused_whole_where_saved_so(layouts: list[ParamLayout], shapes: dict) -> None:
    """Read fused parameters from one whole tensor where the checkpoint holds them so
    (``shapes``: global tensor key -> shape): checkpoints written before expert weights
    at etp = 1 were stored part by part keep ``...experts.fc1`` (gate|up) whole.

    A rank that holds its parameter unsplit (etp = 1) reads it as one block of the whole
    tensor; ``layouts`` are changed in place. A split one (etp > 1) would need two
    blocks of one key, which a state dict cannot hold: that raises a CheckpointError
    saying how to convert the checkpoint."""
    for layout in layouts:
        pieces = layout.pieces
        if (len(pieces) < 2 or layout.key not in shapes
                or any(piece.key in shapes for piece in pieces)):
            continue
        local = tuple(layout.param.shape)
        dim = param_meta(layout.param).partition_dim
        if tuple(shapes[layout.key])[dim] != local[dim]:
            raise CheckpointError(
                f"the checkpoint stores {layout.key!r} whole (as megalite wrote expert "
                "weights at --expert-tensor-parallel-size 1 before resharding them was "
                "supported); load it once at --expert-tensor-parallel-size 1 and save "
                "again, then any expert tensor parallel size loads it")
        first = pieces[0]
        layout.pieces = [Piece(layout.key, tuple(shapes[layout.key]), first.offsets, local)]


def saved_global_shape(layout: ParamLayout, shapes: dict) -> tuple[int, ...] | None:
    """The full shape a checkpoint holds for ``layout``'s parameter (``shapes``: global
    tensor key -> shape), reassembling parts; None if a key is missing."""
    keys = piece_keys(layout)
    if keys[0] not in shapes and layout.key in shapes and len(keys) > 1:
        return tuple(shapes[layout.key])    # saved whole (see read_fused_whole_where_saved_so)
    found = [shapes.get(k) for k in keys]
    if any(s is None for s in found):
        return None
    out = list(found[0])
    if len(found) > 1:
        dim = param_meta(layout.param).partition_dim
        out[dim] = sum(s[dim] for s in found)
    return tuple(out)
