"""Data-parallel gradient reduction with contiguous fp32 buffers and bucketed all-reduce.

Every trainable parameter gets ``param.main_grad``: an fp32 view into one flat buffer. A
post-accumulate-grad hook adds each micro-batch's ``param.grad`` (in the parameter's dtype,
fp32/bf16/fp16) into ``main_grad`` and frees ``param.grad``, so gradients accumulate in
fp32 across micro-batches whatever the training precision.

After the last micro-batch :meth:`DataParallelGrads.finish_grad_sync` reduces:

1. sequence-parallel parameters (``param.sequence_parallel``): SUM over ``ps.tp``
   (each tp rank saw a different slice of the sequence);
2. a word embedding shared between first and last pipeline stage
   (``param.shared_embedding``, pp > 1): SUM over ``ps.embedding``;
3. every buffer, bucket by bucket: SUM over ``ps.dp_cp`` for dense parameters, over
   ``ps.edp`` for expert parameters (``param.allreduce is False`` or ``param.is_expert``).

Gradients are summed, not averaged: the training loop divides the loss by the number of
valid tokens in the whole global batch, so the sum is already the global mean.
Overlapping the reduction with backward and sharding it (distributed optimizer) is the job
of a later module; this one is plain and synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.parallel.state import Group, ParallelState

DEFAULT_BUCKET_SIZE = 40_000_000  # elements


def is_expert_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, "is_expert", False)) or getattr(param, "allreduce", True) is False


@dataclass
class GradBuffer:
    """One flat fp32 buffer of gradients reduced over one group, split into buckets."""

    group: Group
    params: list
    data: torch.Tensor = field(repr=False, default=None)
    buckets: list = field(repr=False, default_factory=list)

    @classmethod
    def build(cls, params: list, group: Group, bucket_size: int,
              device: torch.device) -> GradBuffer:
        """Lay ``params`` out back to front (the order backward produces gradients) and
        attach ``param.main_grad`` views. Buckets hold whole parameters and at least
        ``bucket_size`` elements (the last one may be smaller)."""
        ordered = list(reversed(params))
        total = sum(p.numel() for p in ordered)
        buf = cls(group=group, params=ordered,
                  data=torch.zeros(total, dtype=torch.float32, device=device))
        offset, start = 0, 0
        for p in ordered:
            n = p.numel()
            p.main_grad = buf.data[offset:offset + n].view(p.shape)
            offset += n
            if offset - start >= bucket_size:
                buf.buckets.append(buf.data[start:offset])
                start = offset
        if offset > start:
            buf.buckets.append(buf.data[start:offset])
        return buf

    def all_reduce(self) -> None:
        """SUM every bucket over ``self.group`` (async launch, then wait for all)."""
        if self.group.size == 1:
            return
        handles = [dist.all_reduce(b, group=self.group.group, async_op=True)
                   for b in self.buckets]
        for h in handles:
            h.wait()


class DataParallelGrads:
    """fp32 gradient accumulation and the data-parallel all-reduce for one model.

    ``params``: the model's trainable parameters (``model.parameters()`` order).
    """

    def __init__(self, params, ps: ParallelState, bucket_size: int | None = None,
                 timers=None):
        self.ps = ps
        self.timers = timers
        self.params = [p for p in params if p.requires_grad]
        size = bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * ps.dp_cp.size)
        dense = [p for p in self.params if not is_expert_param(p)]
        expert = [p for p in self.params if is_expert_param(p)]
        self.buffers = [GradBuffer.build(dense, ps.dp_cp, size, ps.device)]
        if expert:
            self.buffers.append(GradBuffer.build(expert, ps.edp, size, ps.device))
        self._hooks = [p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
                       for p in self.params]

    def zero_grad(self) -> None:
        """Clear the fp32 buffers (and any stray ``param.grad``) before a step."""
        for buf in self.buffers:
            buf.data.zero_()
        for p in self.params:
            p.grad = None

    def finish_grad_sync(self) -> None:
        """Reduce gradients after the last micro-batch's backward (see module docstring)."""
        timer = self.timers("grads-all-reduce", log_level=2) if self.timers else None
        if timer:
            timer.start()
        sp = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        _all_reduce_coalesced([p.main_grad for p in sp], self.ps.tp)
        if self.ps.pp.size > 1 and self.ps.embedding.member:
            shared = [p for p in self.params if getattr(p, "shared_embedding", False)]
            _all_reduce_coalesced([p.main_grad for p in shared], self.ps.embedding)
        for buf in self.buffers:
            buf.all_reduce()
        if timer:
            timer.stop()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def _all_reduce_coalesced(tensors: list, group: Group) -> None:
    """SUM a few tensors over ``group`` through one flat copy (in place)."""
    if group.size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group.group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
