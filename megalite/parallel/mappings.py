"""Autograd-aware collectives for tensor and sequence parallelism, and the all-to-all of
context and expert parallelism.

Every function takes the process group as a :class:`megalite.parallel.state.Group`
(``ps.tp`` for tensor/sequence parallelism, ``ps.cp`` for the all-to-all of
``--cp-comm-type a2a``, ``ps.ep`` for the MoE token dispatch) and is the identity when the
group has one member, so single-process code never touches ``torch.distributed``.

Tensor-parallel (TP) regions split the *last* dimension (hidden or vocab); sequence-parallel
(SP) regions split the *first* dimension, the sequence of Megatron's ``[s, b, h]`` layout.
Each forward collective is paired with its adjoint in backward:

==========================================  ======================  ======================
function                                    forward                 backward
==========================================  ======================  ======================
copy_to_tensor_model_parallel_region        identity                all-reduce
reduce_from_tensor_model_parallel_region    all-reduce              identity
scatter_to_tensor_model_parallel_region     split last dim          all-gather last dim
gather_from_tensor_model_parallel_region    all-gather last dim     split last dim
scatter_to_sequence_parallel_region         split dim 0             all-gather dim 0
gather_from_sequence_parallel_region        all-gather dim 0        reduce-scatter dim 0
reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0    all-gather dim 0
all_to_all                                  all-to-all of dim-0     the reverse all-to-all
                                            row blocks
==========================================  ======================  ======================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megalite.parallel import collectives as C


# -- raw collectives (no autograd; the bodies live in megalite.parallel.collectives) -----
def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group.size == 1:
        return x
    return C.all_reduce(x.contiguous(), group)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    if group.size == 1:
        return x
    size = x.shape[-1]
    if size % group.size:
        raise ValueError(f"last dim {size} is not divisible by the group size {group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    if group.size == 1:
        return x
    stacked = C.all_gather_dim0(x.unsqueeze(0), group)  # [tp, ..., n/tp]
    return torch.cat(stacked.unbind(0), dim=-1)


def _split_first(x: torch.Tensor, group) -> torch.Tensor:
    if group.size == 1:
        return x
    size = x.shape[0]
    if size % group.size:
        raise ValueError(f"dim 0 ({size}) is not divisible by the group size {group.size}")
    return x.chunk(group.size, dim=0)[group.rank].contiguous()


# -- autograd functions ------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # clone: the incoming gradient may be shared with other consumers
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_dim0(grad, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.reduce_grad = tensor_parallel_output_grad
        return C.all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return C.reduce_scatter_dim0(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_dim0(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send, recv, exchange, side):
        ctx.group, ctx.send, ctx.recv, ctx.exchange = group, send, recv, exchange
        if side is None:
            return exchange(x, group, send, recv)
        return exchange(x, group, send, recv, side=side)

    @staticmethod
    def backward(ctx, grad):
        # the reverse exchange: what was received goes back to where it came from
        back = ctx.exchange(grad.contiguous(), ctx.group, ctx.recv, ctx.send)
        return back, None, None, None, None, None


# -- public API --------------------------------------------------------------------------
def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: ``[..., h]`` -> ``[..., h]`` unchanged; backward all-reduces
    the gradient over ``group`` (each rank's partial gradient of a replicated input)."""
    if group.size == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region: sum the partial results ``[..., h]`` over ``group``;
    backward passes the gradient through."""
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., n]`` -> this rank's ``[..., n/tp]`` slice; backward all-gathers over
    ``group`` along the last dim."""
    if group.size == 1:
        return x
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., n/tp]`` -> ``[..., n]`` by all-gather over ``group`` (rank order);
    backward keeps this rank's slice of the gradient."""
    if group.size == 1:
        return x
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, b, h]`` -> this rank's ``[s/tp, b, h]`` chunk; backward all-gathers the
    gradient over ``group`` along the sequence."""
    if group.size == 1:
        return x
    return _ScatterToSP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """``[s/tp, b, h]`` -> ``[s, b, h]`` by all-gather over ``group``.

    Backward reduce-scatters the gradient when the consumer is a TP region (each rank
    holds a partial gradient of the full sequence, the default); with
    ``tensor_parallel_output_grad=False`` the gradient is already complete on every rank
    and backward only keeps this rank's chunk.
    """
    if group.size == 1:
        return x
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region into an SP region: partial sums ``[s, b, h]`` -> this rank's
    chunk of their sum ``[s/tp, b, h]`` (reduce-scatter over ``group``); backward
    all-gathers the gradient along the sequence."""
    if group.size == 1:
        return x
    return _ReduceScatterToSP.apply(x, group)


def all_to_all(x: torch.Tensor, group, send: Sequence[int] | None = None,
               recv: Sequence[int] | None = None, exchange=C.all_to_all,
               side=None) -> torch.Tensor:
    """All-to-all of dim-0 row blocks over ``group`` (``all_to_all_single``); backward
    sends the gradient back the reverse way. ``exchange(x, group, send, recv)`` runs the
    collective both ways (:func:`megalite.parallel.collectives.all_to_all`; the MoE
    dispatch passes one that can overlap, :mod:`megalite.moe.comm`). ``side``: work for
    the forward's exchange to run while it is in flight, passed as
    ``exchange(..., side=side)`` (the MoE shared experts, :mod:`megalite.moe.shared_overlap`);
    not run when ``group`` has one member, nor in backward.

    Even (``send``/``recv`` None): ``x`` ``[n * m, ...]`` (n = ``group.size``), block r
    goes to rank r; returns ``[n * m, ...]`` whose block r came from rank r. Uneven:
    ``x`` ``[sum(send), ...]``, its first ``send[0]`` rows go to rank 0, the next
    ``send[1]`` to rank 1, ...; returns ``[sum(recv), ...]`` with ``recv[r]`` rows from
    rank r, in rank order (both sides must know the sizes).
    """
    if group.size == 1:
        return x
    if send is not None:
        send, recv = list(send), list(recv)
    return _AllToAll.apply(x, group, send, recv, exchange, side)
