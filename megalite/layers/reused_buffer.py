"""Storage handed out again once nothing else refers to it (large per-step tensors)."""

from __future__ import annotations

import torch

from megalite.parallel import weight_grad


class ReusedGradBuffer:
    """A buffer handed out again once its previous user dropped it.

    :meth:`empty` returns a tensor of ``shape``: a new tensor object on the kept storage
    when no other tensor refers to it any more (use count of the storage), else on newly
    allocated storage, which is kept from then on. :meth:`zeros` is the same, zero-filled.
    On CPU this saves the page faults of a fresh allocation above glibc's mmap threshold
    (32 MiB at most) every step: the embedding table's gradient
    (:mod:`megalite.layers.embedding`) and the output layer's logits and weight gradient
    (:func:`reused_linear`). Only on CPU: a GPU's caching allocator already hands
    storage out again, and there a kept buffer would only add memory between steps. The
    kept storage stays allocated between steps; the planner's memory model counts it for
    CPU runs (``megalite.planner.memory``, ``device_type="cpu"``).
    """

    def __init__(self):
        self._storage = None

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        st = self._storage
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if (st is not None and st.device == torch.device(device) and st.nbytes() == nbytes
                and torch._C._storage_Use_Count(st._cdata) == 1):
            return torch.empty(0, dtype=dtype, device=device).set_(st, 0, shape)
        out = torch.empty(shape, dtype=dtype, device=device)
        self._storage = out.untyped_storage()
        return out

    def zeros(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        return self.empty(shape, dtype, device).zero_()


class _ReusedLinear(torch.autograd.Function):
    """``x [..., in] @ weight[out, in].T -> [..., out]`` whose output and weight gradient
    are written into kept storage; the same products as ``F.linear`` without bias (one
    ``mm`` each way, bit for bit)."""

    @staticmethod
    def forward(ctx, x, weight, out_buffer, grad_buffer):
        ctx.save_for_backward(x, weight)
        ctx.grad_buffer = grad_buffer
        x2 = x.reshape(-1, x.shape[-1])
        out = out_buffer.empty((x2.shape[0], weight.shape[0]), x.dtype, x.device)
        torch.mm(x2, weight.t(), out=out)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g2.mm(weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_buffer = ctx.grad_buffer

            def compute():
                out = grad_buffer.empty(weight.shape, weight.dtype, weight.device)
                return torch.mm(g2.t(), x.reshape(-1, x.shape[-1]), out=out)
            dw = weight_grad.weight_grad(weight, compute)   # None: deferred to a W step
        return dx, dw, None, None


def reused_linear(x: torch.Tensor, weight: torch.Tensor, out_buffer: ReusedGradBuffer,
                  grad_buffer: ReusedGradBuffer) -> torch.Tensor:
    """``F.linear(x, weight)`` (``[..., in] -> [..., out]``, no bias) with its output
    in ``out_buffer``'s storage and the weight gradient in ``grad_buffer``'s, reused from
    step to step (the output layer's ``[s b, V/tp]`` logits and ``[V/tp, h]`` gradient on
    CPU: about 8% of a CPU step is page faults of their fresh allocations otherwise).
    Plain ``F.linear`` under ``torch.compile`` or autocast, or without autograd."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or torch.is_autocast_enabled(x.device.type) or x.dtype != weight.dtype
            or not (x.requires_grad or weight.requires_grad)):
        return torch.nn.functional.linear(x, weight)
    return _ReusedLinear.apply(x, weight, out_buffer, grad_buffer)
