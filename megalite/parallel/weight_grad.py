"""Deferred weight gradients: a backward split into B (input gradients) and W (weights').

Zero-bubble pipeline schedules (``megalite.pipeline.zero_bubble``) run a micro-batch's
backward as two steps: **B** computes the gradient of the stage's input, which the
previous stage waits for, and **W** the weight-gradient GEMMs, which nobody waits for and
which fill the pipeline's idle time. Two switches, module state shared by every thread
(on a GPU the autograd engine runs backward functions on its own device thread):

* :func:`splittable` (around a forward): the linear layers (``megalite.layers.linear``),
  the experts' grouped GEMM (``megalite.moe.experts``) and the word embedding's lookup
  (``megalite.layers.embedding``) build their graph from autograd functions whose
  backward can leave out the weight gradient. Outside it they use their usual functions,
  so nothing changes for a schedule without W steps.
* :func:`deferring` (around a backward): such a backward returns the input gradient (and
  the bias's; autograd computes every other parameter's: norms, the learned position
  embedding, the router) and queues a :class:`WeightGrad` per weight GEMM and for the
  word embedding's table, in the order the fused backward would have formed them. The
  sequence-parallel all-gather of a column-parallel layer's input (over ``ps.tp``) then
  runs in W, beside the GEMM that needs it.

:func:`apply` runs a queue (the W step): each entry's GEMM, then autograd's own
accumulation of that parameter (the autograd engine run from the tensor the layer used
as its weight), so ``param.grad`` accumulates and the post-accumulate-grad hooks fire --
the gradient buffers' ``main_grad`` sum, the overlapped bucket reduction, the distributed
optimizer's -- exactly as in the fused backward. The products are the fused backward's
own (same operands, same kernels), so B then W gives the fused gradients bit for bit;
across micro-batches each parameter still receives its gradients in micro-batch order
when the W steps run in that order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

_split = False
_queue: list[WeightGrad] | None = None


@dataclass
class WeightGrad:
    """One deferred weight gradient: ``compute()`` returns the gradient of ``weight`` (the
    tensor the layer multiplied by: a parameter, or a tensor computed from one, such as
    the tied output layer's word embedding)."""

    weight: torch.Tensor
    compute: Callable[[], torch.Tensor]
    accumulator: object = None   # keeps the parameter's accumulation node alive until W


@contextlib.contextmanager
def splittable() -> Iterator[None]:
    """Forwards inside build graphs whose weight gradients :func:`deferring` can defer."""
    global _split
    prev, _split = _split, True
    try:
        yield
    finally:
        _split = prev


def split_enabled(device_type: str) -> bool:
    """Whether a layer's forward on ``device_type`` (``"cpu"``, ``"cuda"``) should use its
    deferrable autograd function (inside :func:`splittable`, with autograd recording,
    outside ``torch.compile`` and autocast, whose graphs keep their own functions)."""
    return (_split and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled(device_type))


@contextlib.contextmanager
def deferring() -> Iterator[list[WeightGrad]]:
    """A backward run inside queues its deferrable weight gradients in the yielded list
    (for :func:`apply`) instead of computing them."""
    global _queue
    prev, _queue = _queue, []
    try:
        yield _queue
    finally:
        _queue = prev


def deferring_now() -> bool:
    """Whether a backward running now should queue its weight gradients."""
    return _queue is not None


def weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]
                ) -> torch.Tensor | None:
    """Called by a deferrable backward for its weight: ``compute()`` now (a fused
    backward), or None after queueing it (inside :func:`deferring`)."""
    if _queue is None:
        return compute()
    _queue.append(WeightGrad(weight, compute, _accumulator(weight)))
    return None


def _accumulator(weight: torch.Tensor):
    """The autograd node that accumulates into ``weight`` when it is a leaf (a parameter):
    held from B to W. Under full recomputation the weight a backward unpacks is an alias
    of the parameter that reaches it through this node, which autograd holds only weakly:
    once no graph uses the parameter (its chunk's last backward ran, the next forward has
    not), the node is gone and a W step run from the alias would accumulate into the
    alias instead."""
    if weight.grad_fn is not None or not weight.requires_grad:
        return None
    with torch.enable_grad():
        return weight.view_as(weight).grad_fn.next_functions[0][0]


def apply(queue: list[WeightGrad]) -> None:
    """Run the deferred weight gradients of ``queue`` in order (the W step), each handed
    to autograd's accumulation of its weight (``param.grad``, post-accumulate-grad hooks);
    empties ``queue``.

    A weight queued more than once (the word embedding tied to the output layer on one
    stage) gets the sum of its gradients, added in queue order, in one accumulation, as
    the fused backward sums a tensor's incoming gradients before accumulating them."""
    left: dict[int, int] = {}
    for item in queue:
        left[id(item.weight)] = left.get(id(item.weight), 0) + 1
    partial: dict[int, torch.Tensor] = {}
    while queue:
        item = queue.pop(0)
        key = id(item.weight)
        with torch.no_grad():   # as inside a backward: the saved tensors may require grad
            grad = item.compute()
            if key in partial:
                grad = partial.pop(key) + grad
        left[key] -= 1
        if left[key]:
            partial[key] = grad
            continue
        # the engine itself, as torch.autograd.backward would call it (whose argument
        # checks import sympy on first use: over a second, once per process)
        torch.autograd.Variable._execution_engine.run_backward(
            (item.weight,), (grad,), False, False, (), True, True)
