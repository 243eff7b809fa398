"""Muon at any layout: each whole (logical) matrix orthogonalised exactly once per
model-parallel group, from momentum pieces held anywhere.

A Muon matrix (:class:`Matrix`) is one parameter as :mod:`megalite.layers.sharding` sees
it: its full tensor is the tp shards reassembled part by part (``unshard``), an expert
stack ``[E, a, b]`` is ``E`` matrices. Orthogonalising it is one Newton-Schulz
iteration (:func:`megalite.optim.newton_schulz.orthogonalize`) per matrix -- per Q, K
and V part of a fused QKV weight with --muon-split-qkv -- times the scale of
``--muon-scale-mode`` for that matrix's ``[out, in]`` shape (dense weights are ``[out,
in]``, expert stacks ``[E, in, out]``). The
matrices a rank orthogonalises whole are iterated together (:func:`orthogonalize_batched`):
the parts of equal shape (after the Q/K/V split; an expert stack counts as ``E`` parts
of its shape) are stacked into ``[B, m, n]`` batches of at
most :data:`MUON_BATCH_BYTES`, one Newton-Schulz iteration per batch rather than per
matrix: fewer, larger kernels on a GPU, and on the CPU bitwise the one-at-a-time result.

Tensor parallelism (``--muon-tp-mode``, Megatron-LM's meanings), on ``ps.tp`` (``ps.etp``
for experts), for a parameter whose ``U`` this rank holds as its tp shard:

- ``duplicated``: the full matrix from the gathered shards, orthogonalised as a whole.
  Megatron-LM all-gathers and orthogonalises it on every tp rank; here each matrix has
  an owner tp rank (balanced by FLOPs) that receives the shards, orthogonalises once and
  sends each rank its shard back (:func:`_gathered_once`: the same result, the work done
  once per tp group);
- ``distributed``: no gather; each rank keeps its rows or columns and the Newton-Schulz
  Gram matrix and norm are all-reduced each step
  (:func:`megalite.optim.newton_schulz.newton_schulz` with a group);
- ``blockwise``: each shard orthogonalised on its own, with its own shape's scale (what
  Megatron-LM's default does). The update then depends on tp: it is the one mode not
  equal to the single-process update.

Data parallelism: without the distributed optimizer every replica holds the whole local
``U`` and orthogonalises it (the same work on each dp rank, as Megatron-LM's Muon). With
it (:class:`OwnerExchange`), the momentum lives in 1-D pieces of dp shards; each matrix is
owned by one rank of its gradient group (``ps.dp_cp``, ``ps.edp`` for experts), chosen
by longest-processing-time-first over the Newton-Schulz FLOPs; one all-to-all sends every
piece of ``U`` to its owner, the owner's tp group orthogonalises it (as above, the owners
of one matrix on the tp ranks form one tp group), and a second all-to-all returns each
rank its pieces of ``O``. Every matrix is gathered on one dp rank, never on all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.layers.sharding import shard, unshard
from megalite.optim.newton_schulz import (newton_schulz, ns_flops, orthogonalize_stack,
                                            scale_factor)
from megalite.parallel import collectives
from megalite.parallel.params import param_meta


def check_matrix(name: str, param: torch.Tensor, ocfg) -> None:
    """Raise ValueError when Muon cannot orthogonalise ``param`` (named)."""
    meta = param_meta(param)
    if meta.unpadded_size is not None:
        raise ValueError(f"Muon cannot orthogonalise {name}: it is padded along dimension "
                         f"{meta.partition_dim} (a vocabulary); it belongs to the scalar "
                         "optimizer")
    if meta.tensor_parallel and meta.partition_dim < param.dim() - 2:
        raise ValueError(f"Muon cannot orthogonalise {name}: it is split over tensor "
                         f"parallelism along dimension {meta.partition_dim}, not one of its "
                         f"matrix dimensions (shape {tuple(param.shape)})")
    if split_parts(name, param, ocfg) is None and ocfg.muon_split_qkv \
            and name.endswith("linear_qkv.weight"):
        raise ValueError(f"Muon cannot split {name} into Q, K and V: it has no [Q; K; V] "
                         "parts; run with --muon-no-split-qkv")


def split_parts(name: str, param: torch.Tensor, ocfg) -> tuple[int, ...] | None:
    """Full sizes along dimension 0 of the parts orthogonalised apart: Q, K and V of a
    fused QKV weight under --muon-split-qkv (all heads of Q are one matrix, as in
    Megatron-LM's split per query group), else None (one matrix)."""
    parts = param_meta(param).partition_parts
    if ocfg.muon_split_qkv and name.endswith("linear_qkv.weight") and parts \
            and len(parts) == 3 and param_meta(param).partition_dim == 0:
        return parts
    return None


@dataclass
class Matrix:
    """One Muon parameter: ``param`` (the model's, for its metadata), the tp ``group`` it
    is split over (``ps.tp``, or ``ps.etp`` for experts), the parts orthogonalised apart."""

    name: str
    param: torch.Tensor
    group: object
    parts: tuple[int, ...] | None

    @property
    def expert(self) -> bool:
        return param_meta(self.param).expert

    def full_shape(self) -> tuple[int, ...]:
        meta, shape = param_meta(self.param), list(self.param.shape)
        if meta.tensor_parallel:
            shape[meta.partition_dim] *= self.group.size
        return tuple(shape)

    def cost(self, steps: int) -> float:
        """Newton-Schulz FLOPs of the whole parameter (every expert, every part)."""
        shape = self.full_shape()
        count = shape[0] if self.expert else 1
        rows = self.parts or (shape[-2],)
        return count * sum(ns_flops(r, shape[-1], steps) for r in rows)


def matrices(named_params, ps, ocfg) -> list[Matrix]:
    """The :class:`Matrix` of each ``(name, param)`` given (Muon's parameters)."""
    return [Matrix(n, p, ps.etp if param_meta(p).expert else ps.tp, split_parts(n, p, ocfg))
            for n, p in named_params]


def _factor(shape: tuple, expert: bool, ocfg) -> float:
    """The scale of a matrix of ``shape`` (``[out, in]``, experts ``[in, out]``) times
    --muon-extra-scale-factor."""
    out, inp = (shape[-1], shape[-2]) if expert else (shape[-2], shape[-1])
    return scale_factor(out, inp, ocfg.muon_scale_mode) * ocfg.muon_extra_scale_factor


def _scaled(o: torch.Tensor, shape: tuple, expert: bool, ocfg) -> torch.Tensor:
    """``o`` times the scale of a matrix of ``shape`` (:func:`_factor`)."""
    return o * _factor(shape, expert, ocfg)


# Bytes of stacked fp32 input one batched Newton-Schulz iteration takes at most
# (:func:`orthogonalize_batched`). The iteration holds up to five tensors of its batch's
# size at its peak (the input stack, X, a X, the product with X and their sum; the Gram
# matrices are the smaller side's), so a batch costs about 1.25 GiB of transient memory at
# this bound; a single part larger than it runs alone, as it would unbatched.
MUON_BATCH_BYTES = 256 * 2 ** 20


def orthogonalize_batched(jobs: list, ocfg) -> list[torch.Tensor]:
    """Orthogonalised and scaled (``--muon-scale-mode`` of each part's shape) each of
    ``jobs`` ``[(full, Matrix, parts)]`` (a matrix ``[a, b]`` or an expert stack ``[E, a,
    b]``, cut into ``parts`` along dimension 0 when given), with the parts of equal shape
    iterated together.

    The parts of one ``(m, n)`` are stacked, in the order of ``jobs``, into ``[B, m, n]``
    batches of at most :data:`MUON_BATCH_BYTES` of fp32 input (an expert stack counts
    ``E`` matrices and is never cut; one larger than the bound runs alone): one
    :func:`~megalite.optim.newton_schulz.orthogonalize_stack` per batch instead of one per
    part, which normalises the parts straight into a stack of the iteration's dtype (bf16
    on a GPU), and each part's result is scaled into its place in a contiguous fp32
    ``O`` of its job's shape (Q, K and V into one tensor, not concatenated).
    The grouping depends only on the shapes and their order, so ranks passing the same
    list run the same batches. On the CPU the result is bitwise that of one part at a
    time (:func:`~megalite.optim.newton_schulz.orthogonalize`); on a GPU the batched
    kernels may round differently. No collectives."""
    steps, kind = ocfg.muon_num_ns_steps, ocfg.muon_coefficient_type
    prec = ocfg.muon_fp32_matmul_prec
    results = [torch.empty(full.shape, dtype=torch.float32, device=full.device)
               for full, _, _ in jobs]
    pieces = []             # (job, its [k, m, n] view, the part's shape, its place in O)
    groups: dict[tuple[int, int], list[int]] = {}
    for j, (full, _, parts) in enumerate(jobs):
        cut = list(parts) if parts is not None else [full.shape[0]]
        for x, target in zip(full.float().split(cut, dim=0), results[j].split(cut, dim=0)):
            y = x.reshape(-1, *x.shape[-2:])
            groups.setdefault(tuple(y.shape[-2:]), []).append(len(pieces))
            pieces.append((j, y, x.shape, target))
    for members in groups.values():
        for batch in _batches(members, [pieces[i][1].numel() * 4 for i in members]):
            o = orthogonalize_stack([pieces[i][1] for i in batch], steps, kind, prec)
            for i, oi in zip(batch, o.split([pieces[i][1].shape[0] for i in batch])):
                j, _, shape, target = pieces[i]
                # (two passes: one mixed-dtype multiply into fp32 reads less but takes
                # torch's unvectorised casting path, 8x slower than these on the CPU)
                target.copy_(oi.reshape(shape))           # to fp32
                target.mul_(_factor(shape, jobs[j][1].expert, ocfg))
            del o
    return results


def _batches(members: list[int], sizes: list[int]) -> list[list[int]]:
    """``members`` cut, in order, into runs of at most :data:`MUON_BATCH_BYTES` (``sizes``
    their bytes); a member larger than the bound is a run of its own."""
    out: list[list[int]] = []
    total = 0
    for i, size in zip(members, sizes):
        if not out or total + size > MUON_BATCH_BYTES:
            out.append([])
            total = 0
        out[-1].append(i)
        total += size
    return out


def _distributed(u: torch.Tensor, mat: Matrix, ocfg) -> torch.Tensor:
    """The ``distributed`` mode: Newton-Schulz on this rank's rows or columns, Gram
    matrices all-reduced over ``mat.group``."""
    meta, group = param_meta(mat.param), mat.group
    rows = meta.partition_dim == u.dim() - 2     # split along the matrix's rows
    pieces = u.split([p // group.size for p in mat.parts], dim=0) if mat.parts else [u]
    outs = []
    for x in pieces:
        shape = list(x.shape)
        shape[meta.partition_dim] *= group.size
        y = x.mT if rows else x                  # its columns are the split dimension
        o = newton_schulz(y, ocfg.muon_num_ns_steps, ocfg.muon_coefficient_type, group,
                          ocfg.muon_fp32_matmul_prec)
        outs.append(_scaled(o.mT if rows else o, tuple(shape), mat.expert, ocfg))
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


def orthogonalize_local(pairs: list, ocfg) -> list[torch.Tensor]:
    """``O`` for ``pairs`` ``[(Matrix, U of its local shape)]`` held whole on this rank
    (each tp shard complete). Every rank of a tp group passes the same matrices in the same
    order and runs the same collectives: the ``distributed`` mode's matrix by matrix (dense
    first, then experts), then the ``duplicated`` mode's split matrices in one exchange per
    tp group (:func:`_gathered_once`). The matrices orthogonalised here whole (not split
    over tp, or ``blockwise``) are iterated in batches of equal part shapes
    (:func:`orthogonalize_batched`)."""
    out: list = [None] * len(pairs)
    once: dict[str, list] = {}
    whole: list = []        # (index, U, Matrix, parts) iterated in batches
    for i in sorted(range(len(pairs)), key=lambda i: pairs[i][0].expert):
        mat, u = pairs[i]
        split = param_meta(mat.param).tensor_parallel and mat.group.size > 1
        if split and ocfg.muon_tp_mode == "duplicated":
            once.setdefault(mat.group.name, []).append((i, mat, u))
        elif not split:
            whole.append((i, u, mat, mat.parts))
        elif ocfg.muon_tp_mode == "blockwise":
            local = tuple(p // mat.group.size for p in mat.parts) if mat.parts else None
            whole.append((i, u, mat, local))
        else:
            out[i] = _distributed(u.float(), mat, ocfg)
    for (i, *_), o in zip(whole, orthogonalize_batched([w[1:] for w in whole], ocfg)):
        out[i] = o
    for items in once.values():
        for i, o in _gathered_once(items, ocfg).items():
            out[i] = o
    return out


def _gathered_once(items: list, ocfg) -> dict[int, torch.Tensor]:
    """The ``duplicated`` mode, each matrix computed once: ``items`` ``[(index, Matrix,
    U shard)]`` of one tp group ``G``; each matrix gets an owner rank of ``G`` (LPT by
    Newton-Schulz FLOPs), one all-to-all over ``G`` sends it every shard, it reassembles
    (``unshard``), orthogonalises and cuts the result (``shard``), and a second all-to-all
    returns each rank its shards. The result is that of orthogonalising the gathered matrix
    on every rank (Megatron-LM's duplicated mode), with the work done once."""
    group = items[0][1].group
    size, me = group.size, group.rank
    owners = assign_owners([m.cost(ocfg.muon_num_ns_steps) for _, m, _ in items], size)
    device = items[0][2].device
    mine = [k for k, o in enumerate(owners) if o == me]
    sizes = [sum(items[k][2].numel() for k in range(len(items)) if owners[k] == q)
             for q in range(size)]
    per = sizes[me]           # every rank's shards of my matrices are of the same shapes
    send = [items[k][2].float().reshape(-1) for q in range(size)
            for k in range(len(items)) if owners[k] == q]
    recv = collectives.all_to_all(torch.cat(send), group, sizes, [per] * size)
    shards: dict[int, list] = {k: [] for k in mine}
    offset = 0
    for _ in range(size):
        for k in mine:
            u = items[k][2]
            shards[k].append(recv[offset:offset + u.numel()].view(u.shape))
            offset += u.numel()
    jobs = [(unshard(shards[k], items[k][1].param), items[k][1], items[k][1].parts)
            for k in mine]
    del recv, shards          # the reassembled matrices replace the received shards
    results = {}
    for k, full in zip(mine, orthogonalize_batched(jobs, ocfg)):
        mat = items[k][1]
        results[k] = [shard(full, mat.param, size, r).reshape(-1) for r in range(size)]
    back = [results[k][r] for r in range(size) for k in mine]
    empty = torch.zeros(0, device=device)
    got = collectives.all_to_all(torch.cat(back) if back else empty, group, [per] * size,
                                 sizes)
    out, offset = {}, 0
    for q in range(size):
        for k in range(len(items)):
            if owners[k] == q:
                u = items[k][2]
                out[items[k][0]] = got[offset:offset + u.numel()].view(u.shape)
                offset += u.numel()
    return out


def assign_owners(costs: list[float], size: int) -> list[int]:
    """Owner rank of each item: longest processing time first (ties: the lower index,
    the lower rank), the same on every rank."""
    load = [0.0] * size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


class OwnerExchange:
    """The distributed optimizer's Muon: every matrix orthogonalised on one owner rank of
    its gradient group, from the 1-D pieces the ranks' shards hold (module docstring).

    ``buffers``: the :class:`~megalite.optim.grad_buffer.GradBuffer` s (sharded over
    ``buf.group``: ``ps.dp_cp``, ``ps.edp`` for experts); ``muon``: ids of the parameters
    Muon orthogonalises; ``name_of``: id -> name. The plan (owners, and which elements
    every rank's shard holds of each matrix) is computed once, the same on every rank."""

    def __init__(self, buffers, muon: set[int], name_of: dict[int, str], ps, ocfg):
        self.ocfg, self.device = ocfg, ps.device
        self.groups = []    # (group, [(bucket, params in it)], owner of id(param))
        self.matrix: dict[int, Matrix] = {}
        by_group: dict[str, tuple] = {}
        for buf in buffers:
            group, buckets, params = by_group.setdefault(buf.group.name, (buf.group, [], []))
            for bucket in buf.buckets:
                members = [(p, r) for p, r in zip(bucket.params, bucket.ranges)
                           if id(p) in muon]
                buckets.append((bucket, members))
                params += [p for p, _ in members]
        for group, buckets, params in by_group.values():
            mats = matrices([(name_of[id(p)], p) for p in params], ps, ocfg)
            owners = assign_owners([m.cost(ocfg.muon_num_ns_steps) for m in mats], group.size)
            owner = {id(p): o for p, o in zip(params, owners)}
            self.matrix.update({id(p): m for p, m in zip(params, mats)})
            self.groups.append((group, buckets, owner))

    def owned(self) -> dict[str, tuple[int, int, int]]:
        """group name -> (elements of the matrices this rank owns, elements of all its
        Muon matrices, the group's size): over a group, every matrix is owned once."""
        out = {}
        for group, buckets, owner in self.groups:
            params = [p for _, members in buckets for p, _ in members]
            out[group.name] = (sum(p.numel() for p in params if owner[id(p)] == group.rank),
                               sum(p.numel() for p in params), group.size)
        return out

    @staticmethod
    def _segments(buckets, owner: dict, sender: int, receiver: int) -> list:
        """``[(param, a, b)]``: flat elements ``[a, b)`` of each parameter owned by
        ``receiver`` that ``sender``'s shards hold, in bucket order."""
        out = []
        for bucket, members in buckets:
            lo, hi = bucket.shard_range(sender)
            for p, (a, b) in members:
                if owner[id(p)] == receiver and max(a, lo) < min(b, hi):
                    out.append((p, max(a, lo) - a, min(b, hi) - a))
        return out

    @torch.no_grad()
    def run(self, pairs: list) -> list[torch.Tensor]:
        """``pairs`` ``[(piece, U)]`` (a ``_Piece`` of the distributed optimizer and its
        ``[hi - lo]`` update) for every Muon piece of this rank -> each piece's ``O``.
        Collective: an all-to-all over each gradient group there and back, and the owners'
        tp collectives (:func:`orthogonalize_local`)."""
        device = self.device    # offloaded pieces' U are on the host: sent from the device
        owned, back = [], []
        for group, buckets, owner in self.groups:
            me, size = group.rank, group.size
            index = {id(bucket): i for i, (bucket, _) in enumerate(buckets)}
            mine = sorted(((pc, u) for pc, u in pairs if id(pc.param) in owner),
                          key=lambda x: (index[id(x[0].bucket)], x[0].lo))   # bucket order
            by_dest = [[u.float().to(device) for pc, u in mine if owner[id(pc.param)] == q]
                       for q in range(size)]
            send_sizes = [sum(u.numel() for u in chunk) for chunk in by_dest]
            plans = [self._segments(buckets, owner, s, me) for s in range(size)]
            recv_sizes = [sum(b - a for _, a, b in plan) for plan in plans]
            flat = [u for chunk in by_dest for u in chunk]
            send = torch.cat(flat) if flat else torch.zeros(0, device=device)
            recv = collectives.all_to_all(send, group, send_sizes, recv_sizes)
            full: dict[int, torch.Tensor] = {}
            offset = 0
            for plan in plans:
                for p, a, b in plan:
                    if id(p) not in full:
                        full[id(p)] = torch.zeros(p.shape, dtype=torch.float32,
                                                  device=recv.device)
                    full[id(p)].view(-1)[a:b] = recv[offset:offset + b - a]
                    offset += b - a
            params = [p for _, members in buckets for p, _ in members if id(p) in full]
            owned += [(self.matrix[id(p)], full[id(p)]) for p in params]
            back.append((group, mine, owner, plans, send_sizes, recv_sizes, full))
        outs = orthogonalize_local(owned, self.ocfg)
        result = {id(mat.param): o for (mat, _), o in zip(owned, outs)}
        got: dict = {}
        for group, mine, owner, plans, send_sizes, recv_sizes, full in back:
            chunks = [result[id(p)].reshape(-1)[a:b] for plan in plans for p, a, b in plan]
            send = torch.cat(chunks) if chunks else torch.zeros(0, device=device)
            recv = collectives.all_to_all(send, group, recv_sizes, send_sizes)
            offset = 0
            for q in range(group.size):
                for pc, u in mine:
                    if owner[id(pc.param)] == q:
                        got[id(pc.param)] = recv[offset:offset + u.numel()]
                        offset += u.numel()
        return [got[id(pc.param)].to(u.device) for pc, u in pairs]
