"""Column- and row-parallel linear layers (Megatron-LM's tensor-parallel MLP split).

``Y = X A`` with ``A`` split by columns (output features) is :class:`ColumnParallelLinear`:
each rank computes its slice of Y. ``Y = X A`` with ``A`` split by rows (input features)
is :class:`RowParallelLinear`: each rank computes a partial sum from its slice of X,
summed over the TP group. A column layer followed by a row layer needs one all-reduce in
forward and one in backward. Under sequence parallelism the all-reduce becomes an
all-gather of the sequence before the column layer and a reduce-scatter after the row layer.

Activations use the ``[s, b, h]`` layout; every layer takes the ``ParallelState`` ``ps`` and
all its collectives run on ``ps.tp``. With ``fp8`` (an
:class:`~megalite.layers.fp8.Fp8Recipe`) the layer's three GEMMs run in fp8
(:mod:`megalite.layers.fp8`); its tensorwise amaxes are reduced over ``ps.tp`` for the
operands split over tp and over ``ps.cp`` for the activations and gradients (their
sequence is split over cp).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megalite.layers.fp8 import Fp8Scaling, fp8_linear
from megalite.layers.reused_buffer import ReusedGradBuffer, reused_linear
from megalite.parallel.params import mark_param
from megalite.parallel import collectives as C
from megalite.parallel import mappings
from megalite.parallel import weight_grad


class _SequenceParallelLinear(torch.autograd.Function):
    """Under sequence parallelism: all-gather ``x`` ``[s/tp, b, in]`` over the tp group
    along the sequence, then ``F.linear`` -> ``[s, b, out/tp]``; keeps only this rank's
    ``[s/tp, b, in]`` for backward (not the gathered ``[s, b, in]``, tp times larger) and
    gathers it again in backward, overlapped with the input gradient's product, as
    Megatron-LM does. Gradients are the products autograd forms for ``F.linear`` (bit for
    bit); the input gradient is reduce-scattered back to ``[s/tp, b, in]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        full = C.all_gather_dim0(x, group)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x = x.contiguous()
        group = ctx.group
        g2 = grad.reshape(-1, grad.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[1] and weight_grad.deferring_now():
            # split backward: the gather and the GEMM both run in the W step
            def compute():
                full = C.all_gather_dim0(x, group)
                return g2.t().mm(full.view(-1, full.shape[-1]))
            weight_grad.weight_grad(weight, compute)
            dx = g2.mm(weight).view(x.shape[0] * group.size, *x.shape[1:])
        else:
            full = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
            work = C.all_gather_into_tensor(full, x, group, async_op=True)
            dx = g2.mm(weight).view(full.shape)           # while the input is gathered
            if work is not None:
                work.wait()
            if ctx.needs_input_grad[1]:
                dw = g2.t().mm(full.view(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return C.reduce_scatter_dim0(dx, group), dw, db, None


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (``[..., in] -> [..., out]``) whose weight gradient
    may be deferred to a W step (:mod:`megalite.parallel.weight_grad`); its gradients are
    the products autograd forms for ``F.linear`` (``dx = g W``, ``dW = g^T x``,
    ``db = sum g``), bit for bit. Used only inside ``weight_grad.splittable()``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g2.mm(weight).view(*x.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = weight_grad.weight_grad(
                weight, lambda: g2.t().mm(x.reshape(-1, x.shape[-1])))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """``F.linear``, or inside ``weight_grad.splittable()`` its deferrable twin."""
    if weight_grad.split_enabled(x.device.type) and x.dtype == weight.dtype:
        return _DeferrableLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor parallel size ({d})")
    return n // d


class ColumnParallelLinear(torch.nn.Module):
    """``[s, b, in] -> [s, b, out/tp]`` (or ``[s, b, out]`` with ``gather_output``).

    Weight ``[out/tp, in]`` sharded on dim 0; bias ``[out/tp]``. ``parts`` gives the sizes
    of fused outputs (e.g. Q, K, V), each sharded separately (see ``layers.sharding``).
    With ``sequence_parallel`` the input is this rank's ``[s/tp, b, in]`` and is
    all-gathered along the sequence over ``ps.tp`` first. ``skip_weight_param`` makes
    a layer whose weight is passed to ``forward`` (the tied output layer).
    ``reuse_buffers`` (the output layer; no bias): on CPU its output and weight gradient
    reuse their storage from step to step (:func:`megalite.layers.reused_buffer.reused_linear`),
    except under sequence parallelism, where the layer keeps its ``[s/tp, b, in]`` input
    instead of the gathered one (``_SequenceParallelLinear``).
    """

    def __init__(self, input_size: int, output_size: int, *, ps, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, parts: Sequence[int] | None = None,
                 skip_weight_param: bool = False, reuse_buffers: bool = False,
                 fp8=None, device=None, dtype=None):
        super().__init__()
        self.tp_group = tp_group = ps.tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        local = _divide(output_size, tp_group.size, "output size")
        if parts is not None:
            if gather_output and tp_group.size > 1:
                raise ValueError("gather_output with fused parts would return the parts "
                                 "interleaved by rank; gather each part instead")
            for p in parts:
                _divide(p, tp_group.size, "fused output part")
        kw = {"device": ps.device if device is None else device, "dtype": dtype}
        self.weight = None
        if not skip_weight_param:
            self.weight = mark_param(torch.nn.Parameter(torch.empty(local, input_size, **kw)),
                                     partition_dim=0, parts=parts, init_std=init_std)
        self.bias = None
        if bias:
            self.bias = mark_param(torch.nn.Parameter(torch.empty(local, **kw)),
                                   partition_dim=0, parts=parts, init_fill=0.0)
        # the input is whole on every tp rank (replicated, or gathered under sp); the
        # weight [out/tp, in] and the output gradient [s, b, out/tp] are split over tp
        self.fp8_scaling = None if fp8 is None else Fp8Scaling(
            fp8, ((ps.cp,), (tp_group,), (tp_group, ps.cp)), device=kw["device"])
        self._reused = None
        if reuse_buffers and not bias and torch.device(kw["device"] or "cpu").type == "cpu":
            self._reused = (ReusedGradBuffer(), ReusedGradBuffer())  # output, weight grad

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.fp8_scaling is not None:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
            else:
                x = mappings.copy_to_tensor_model_parallel_region(x, self.tp_group)
            y = fp8_linear(x, weight, self.bias, self.fp8_scaling)
        elif (self.sequence_parallel and self.tp_group.size > 1 and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(x.device.type)):
            y = _SequenceParallelLinear.apply(x, weight, self.bias, self.tp_group)
        else:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)
            else:
                x = mappings.copy_to_tensor_model_parallel_region(x, self.tp_group)
            if self._reused is not None:
                y = reused_linear(x, weight, *self._reused)
            else:
                y = _linear(x, weight, self.bias)
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(torch.nn.Module):
    """``[s, b, in/tp] -> [s, b, out]`` (``[s/tp, b, out]`` with ``sequence_parallel``).

    Weight ``[out, in/tp]`` sharded on dim 1; the bias ``[out]`` is replicated and added
    after the reduction over ``ps.tp`` (all-reduce, or reduce-scatter along the sequence
    under sequence parallelism, where the bias is marked ``sequence_parallel``). Without
    ``input_is_parallel`` the full input ``[s, b, in]`` is split here first.
    """

    def __init__(self, input_size: int, output_size: int, *, ps, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_std: float = 0.02, fp8=None, device=None, dtype=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel")
        self.tp_group = tp_group = ps.tp
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        local = _divide(input_size, tp_group.size, "input size")
        kw = {"device": ps.device if device is None else device, "dtype": dtype}
        self.weight = mark_param(torch.nn.Parameter(torch.empty(output_size, local, **kw)),
                                 partition_dim=1, init_std=init_std)
        self.bias = None
        if bias:
            self.bias = mark_param(torch.nn.Parameter(torch.empty(output_size, **kw)),
                                   init_fill=0.0, sequence_parallel=sequence_parallel)
        # the input [s, b, in/tp] and the weight [out, in/tp] are split over tp; the output
        # gradient [s, b, out] is whole on every tp rank
        self.fp8_scaling = None if fp8 is None else Fp8Scaling(
            fp8, ((tp_group, ps.cp), (tp_group,), (ps.cp,)), device=kw["device"])

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_scaling is not None:
            return fp8_linear(x, self.weight, bias, self.fp8_scaling)
        return _linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if self.tp_group.size == 1:
            return self._linear(x, self.bias)
        y = self._linear(x, None)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias
