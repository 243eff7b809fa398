"""Data-parallel gradient reduction: contiguous buffers, buckets, optional overlap.

Every trainable parameter gets ``param.main_grad``, a view into a flat buffer
(:mod:`megalite.optim.grad_buffer`; fp32, or bf16 with ``grad_reduce_in_bf16``). A
post-accumulate-grad hook adds each micro-batch's ``param.grad`` into ``main_grad`` and
frees ``param.grad``, so gradients accumulate across micro-batches in the buffer's dtype.

Reduction, per bucket, over ``ps.dp_cp`` (dense parameters) or ``ps.edp`` (expert
parameters, ``ParamMeta.expert``): an all-reduce SUM, or with the distributed
optimizer (``use_distributed_optimizer``) a reduce-scatter SUM into this rank's shard.
With ``shard_grads`` (``--data-parallel-sharding-strategy optim_grads``, ZeRO-2) the shard
is a buffer of its own and there is no full-size buffer: each bucket is reduce-scattered
into the shard (added) once every one of its parameters has received a gradient since its
last reduction -- once per micro-batch -- and its full gradient is dropped, so a rank holds
its ``1/D`` of the fp32 gradients plus the buckets the backward is filling
(:mod:`megalite.optim.grad_buffer`). Those reductions do not wait for the last micro-batch,
and without ``overlap_grad_reduce`` each completes before backward goes on. Read the
reduced gradients with ``bucket.shard_grad()``.

* ``overlap_grad_reduce`` False: nothing happens during backward; :meth:`finish_grad_sync`
  reduces every bucket after the last micro-batch.
* ``overlap_grad_reduce`` True: a bucket's collective is launched asynchronously from the
  backward hook of the last of its parameters to receive its final gradient, in bucket
  order; :meth:`finish_grad_sync` launches whatever did not become ready (parameters that
  got no gradient) and waits for everything.

**The API the training loop and the pipeline schedules call** (one step)::

    grads.zero_grad(num_microbatches=m)   # before the first forward of the step
    ... m forward/backward passes per model chunk, in any schedule ...
    grads.finish_grad_sync()              # after the last backward, before optimizer.step()

A parameter's gradient is final at its ``m``-th arrival, so interleaved schedules need no
further signal. A schedule may instead (or also) say it explicitly before each backward:
``grads.set_last_microbatch(is_last, chunk=None)`` (``chunk``: index into the model
chunks, None for all); a gradient arriving while its chunk's flag is set is final too.
Without either (``zero_grad()`` and no flag) no collective is launched before
:meth:`finish_grad_sync`: correct, just not overlapped. A gradient that arrives after its
bucket was launched (more backward passes than announced) raises instead of being lost.
All ranks of a group must launch buckets in the same order: the same parameters receive
gradients in the same order on every data-parallel rank (true for a fixed graph).

After the data-parallel sums, :meth:`finish_grad_sync` adds the two model-parallel ones
(sums commute, so doing them last is exact; with the distributed optimizer only this
rank's shard is meaningful and it is what gets summed correctly):

1. sequence-parallel parameters (``param_meta(p).sequence_parallel``): SUM over ``ps.tp``;
2. the word embedding shared by the first and last pipeline stage
   (``param_meta(p).shared_embedding``, pp > 1): SUM over ``ps.embedding``. It sits alone in its
   bucket, so both stages own the same element range of it. Under ZB-V's V placement both
   copies are on the first stage (``ps.embedding`` is that rank alone): summed in place.

Gradients are summed, not averaged: the loop divides the loss by the global token count.

Distributed optimizer parameter sync: :meth:`start_param_sync` all-gathers every bucket's
shards after the optimizer step; with ``overlap_param_gather`` it returns at once and a
forward pre-hook on each module waits for the buckets of that module's own parameters, so
the gather of later layers overlaps the forward of earlier ones. A ``state_dict`` pre-hook
and :meth:`finish_param_sync` wait for everything (call the latter before reading
parameters any other way).

Sharded parameters (``shard_params``, ``--data-parallel-sharding-strategy
optim_grads_params``, ZeRO-3; implies ``shard_grads``): the buffers keep only this rank's
shard of the parameters and :class:`~megalite.optim.param_sharding.ParamSharding` gathers
each layer's buckets around its forward and backward (buckets never span two layers).
:meth:`start_param_sync` then only drops the gathered copies the optimizer step made
stale; :meth:`finish_param_sync` gathers every parameter (collective), so reading
parameters after it works as under the other strategies, until the next forward frees
them layer by layer again.

``--fp8-param-gather`` (``fp8_param_gather``, sharded only): buckets holding weights of
per-tensor fp8 linears get an :class:`~megalite.optim.fp8_param_gather.Fp8BucketGather`,
and both gathers above send those weights as fp8 bytes for training forwards; under the
distributed optimizer their high-precision elements are gathered again only by
:meth:`finish_param_sync` / :meth:`regather_stale` (checkpoints, evaluation).
"""

from __future__ import annotations

import torch

from megalite.optim.fp8_param_gather import attach as fp8_param_gather_attach
from megalite.optim.grad_buffer import Bucket, GradBuffer
from megalite.optim.param_sharding import ParamSharding, find_units
from megalite.parallel.collectives import all_reduce_coalesced
from megalite.parallel.params import is_expert_param, param_meta
from megalite.parallel.state import ParallelState
from megalite.pipeline.layout import model_chunks

DEFAULT_BUCKET_SIZE = 40_000_000  # elements


def bucket_elements(bucket_size: int | None, dp_cp: int) -> int:
    """Elements per gradient bucket: ``--ddp-bucket-size``, or by default
    max(40M, 1M x data-parallel size) as in Megatron-LM."""
    return bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * dp_cp)


def _param_chunks(model) -> list:
    """``model`` as a list of chunks: the pipeline chunks of a Module or list of Modules
    (``pipeline.layout.model_chunks``), or any other iterable of parameters as one chunk."""
    if isinstance(model, torch.nn.Module):
        return model_chunks(model)
    items = list(model)
    if items and all(isinstance(m, torch.nn.Module) for m in items):
        return items
    return [items]


def _chunk_params(chunk) -> list:
    params = chunk.parameters() if isinstance(chunk, torch.nn.Module) else chunk
    return [p for p in params if p.requires_grad]


class DataParallelGrads:
    """Gradient buffers and data-parallel reduction of ``model`` (see module docstring).

    model:        a Module, a list / ModuleList of pipeline chunks, or an iterable of
                  parameters (then ``overlap_param_gather`` degrades to a blocking gather).
    bucket_size:  elements per bucket (``--ddp-bucket-size``); default
                  max(40M, 1M x data-parallel size) as in Megatron-LM.
    trace:        set to a list to record ``(event, chunk, buffer, bucket)`` tuples
                  (``grad-final``, ``grad-sync-start``, ``grad-round-start`` (a
                  ``shard_grads`` bucket's round), ``param-sync-start``,
                  ``param-sync-wait``) for tests of the overlap order.
    shard_params: ZeRO-3 (see module docstring); ``model`` must be modules (chunks).
    prefetch:     with ``shard_params``: gather the next layer while this one computes.
    fp8_param_gather: (sharded) gather the weights of per-tensor fp8 linears as fp8
                  (:mod:`megalite.optim.fp8_param_gather`).
    """

    def __init__(self, model, ps: ParallelState, bucket_size: int | None = None,
                 timers=None, *, overlap_grad_reduce: bool = False,
                 use_distributed_optimizer: bool = False, grad_reduce_in_bf16: bool = False,
                 overlap_param_gather: bool = False, shard_grads: bool = False,
                 shard_params: bool = False, prefetch: bool = True,
                 fp8_param_gather: bool = False):
        if bucket_size is not None and bucket_size <= 0:
            raise ValueError(f"bucket_size must be > 0, got {bucket_size}")
        if overlap_param_gather and not use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer")
        if (shard_grads or shard_params) and not use_distributed_optimizer:
            raise ValueError("shard_grads (optim_grads) and shard_params "
                             "(optim_grads_params) need use_distributed_optimizer")
        self.shard_grads = shard_grads or shard_params
        self.shard_params = shard_params
        self.ps, self.timers = ps, timers
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.sharded = use_distributed_optimizer
        self.grad_dtype = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
        self.bucket_size = bucket_elements(bucket_size, ps.dp_cp.size)
        self.chunks = _param_chunks(model)
        self._units = None
        if shard_params:
            if not all(isinstance(chunk, torch.nn.Module) for chunk in self.chunks):
                raise ValueError("shard_params (optim_grads_params) needs the model's "
                                 "modules, not an iterable of parameters")
            self._units = [find_units(chunk) for chunk in self.chunks]
        self.trace: list | None = None
        self.params: list = []
        self.buffers: list[GradBuffer] = []
        self._where: dict[int, tuple[int, int, Bucket]] = {}  # id(p) -> (chunk, buffer, bucket)
        for c, chunk in enumerate(self.chunks):
            self._build_chunk(c, _chunk_params(chunk))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in self.params]
        if overlap_param_gather:
            self._hooks += self._register_forward_waits()
        self.fp8_buckets = 0
        if fp8_param_gather and use_distributed_optimizer:
            self.fp8_buckets = fp8_param_gather_attach(self.buffers, self.chunks)
        self.param_sharding = None
        if shard_params:
            self.param_sharding = ParamSharding(self._units, self.buffers, prefetch=prefetch)
        self._hooks += [chunk.register_state_dict_pre_hook(self._before_state_dict)
                        for chunk in self.chunks if isinstance(chunk, torch.nn.Module)]
        self._expected: int | None = None
        self._last: list[bool] = [False] * len(self.chunks)
        self._arrivals: dict[int, int] = {}
        self._final: dict[int, int] = {}          # id(bucket) -> final params so far
        self._next_launch: dict[int, int] = {}    # id(buffer) -> next bucket index

    def _build_chunk(self, c: int, params: list) -> None:
        """One buffer per (dense / expert, dtype) of chunk ``c``'s parameters."""
        seen = {id(p) for p in self.params}
        params = [p for p in params if id(p) not in seen]
        self.params += params
        unit_of = None
        if self._units is not None:
            unit_of = {id(p): u for u, unit in enumerate(self._units[c]) for p in unit.params}
        kinds: dict[tuple, list] = {}
        for p in params:
            kinds.setdefault((is_expert_param(p), p.dtype), []).append(p)
        for (expert, _dtype), members in sorted(kinds.items(), key=lambda kv: kv[0][0]):
            group = self.ps.edp if expert else self.ps.dp_cp
            buf = GradBuffer(members, group, self.grad_dtype, self.bucket_size, self.sharded,
                             self.ps.device, shard_grads=self.shard_grads,
                             shard_params=self.shard_params, unit_of=unit_of)
            for bucket in buf.buckets:
                for p in bucket.params:
                    self._where[id(p)] = (c, len(self.buffers), bucket)
            self.buffers.append(buf)

    # -- the per-step API ------------------------------------------------------------------
    def zero_grad(self, num_microbatches: int | None = None) -> None:
        """Clear the buffers (and any stray ``param.grad``) before a step; ``num_microbatches``
        (backward passes per chunk in this step) lets buckets launch during the last one.
        Parameter all-gathers still in flight are left to the forward pre-hooks."""
        for buf in self.buffers:
            buf.zero_()
        for p in self.params:
            p.grad = None
        self._expected = num_microbatches
        self._last = [False] * len(self.chunks)
        self._arrivals.clear()
        self._final.clear()
        self._next_launch.clear()

    def set_last_microbatch(self, is_last: bool, chunk: int | None = None) -> None:
        """Mark the next backward passes of ``chunk`` (None: every chunk) as the step's last
        (True) or not (False)."""
        for c in range(len(self.chunks)) if chunk is None else [chunk]:
            self._last[c] = bool(is_last)

    def finish_grad_sync(self) -> None:
        """Complete every data-parallel reduction, then the tp / embedding sums (see module
        docstring). Call once per step, after the last backward."""
        timer = self.timers("grads-all-reduce", log_level=2) if self.timers else None
        if timer:
            timer.start()
        for buf in self.buffers:
            for bucket in buf.buckets:
                if not bucket.grad_sync_launched:
                    self._launch(bucket)
        for buf in self.buffers:
            for bucket in buf.buckets:
                bucket.wait_grad_sync()
        sp = [self._reduced_grad(p) for p in self.params if param_meta(p).sequence_parallel]
        all_reduce_coalesced([g for g in sp if g.numel()], self.ps.tp)
        if self.ps.pp.size > 1 and self.ps.embedding.member:
            shared = []
            for p in self.params:
                if param_meta(p).shared_embedding:
                    # the whole bucket when not sharded
                    shared.append(self._where[id(p)][2].shard_grad())
            if len(shared) > 2:
                raise RuntimeError(f"{len(shared)} word-embedding copies on one pipeline "
                                   "rank; at most two are summed (the V placement's)")
            if len(shared) == 2:   # ZB-V: the embedding and its copy on this rank
                total = shared[0] + shared[1]
                for grad in shared:
                    grad.copy_(total)
            all_reduce_coalesced(shared, self.ps.embedding)
        if timer:
            timer.stop()

    def _reduced_grad(self, param) -> torch.Tensor:
        """Where ``param``'s reduced gradient lives after the data-parallel reduction:
        ``main_grad`` (not sharded, or ZeRO-1 where summing the whole of it is harmless),
        or under ``shard_grads`` the 1-D part of this rank's shard it intersects (maybe
        empty)."""
        bucket = self._where[id(param)][2]
        if bucket.reduced_shard is None:
            return param.main_grad
        a, b = next(r for p, r in zip(bucket.params, bucket.ranges) if p is param)
        lo, hi = bucket.shard_range()
        s, e = max(a, lo), min(b, hi)
        return bucket.reduced_shard[s - lo:max(s, e) - lo]

    def memory_tensors(self) -> list[torch.Tensor]:
        """The gradient storages this object holds (full buffers, or under ``shard_grads``
        the buckets' rounds held now and the reduced shards), for memory accounting."""
        held = [b.grad_data for b in self.buffers]
        held += [t for b in self.buffers if b.shard_grads for t in b.round_tensors()]
        return held + [b.shard_grad_data for b in self.buffers if b.shard_grad_data is not None]

    def param_memory_tensors(self) -> list[torch.Tensor]:
        """Parameter storages this object holds besides the parameters' own: the
        persistent shards and the gathered bucket copies (``shard_params``; their storage
        is empty while freed)."""
        held = [b.shard_param_data for b in self.buffers if b.shard_param_data is not None]
        return held + [bk.param for b in self.buffers if b.shard_params for bk in b.buckets]

    # -- parameter all-gather (distributed optimizer) ------------------------------------
    def start_param_sync(self) -> None:
        """All-gather every bucket's parameter shards (after the optimizer updated this
        rank's shards); blocking unless ``overlap_param_gather``. Under ``shard_params``
        only frees the gathered copies (stale now): layers gather again when used."""
        if self.param_sharding is not None:
            self.param_sharding.invalidate()   # each layer gathers its buckets when used
            return
        if not self.sharded:
            return
        timer = self.timers("params-all-gather", log_level=2) if self.timers else None
        if timer:
            timer.start()
        # forward needs the last bucket of each buffer first (buffers are back to front)
        for b, buf in enumerate(self.buffers):
            for bucket in reversed(buf.buckets):
                bucket.start_param_sync()
                self._record("param-sync-start", self._where[id(bucket.params[0])][0], b,
                             bucket.index)
        if not (self.overlap_param_gather and self._forward_waits_possible()):
            self.wait_param_sync()
        if timer:
            timer.stop()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight; under ``shard_params`` also
        gather every parameter (collective over each buffer's group), so that they can be
        read (the next forward frees them again, layer by layer). Buckets whose fp8 weights
        were last gathered in fp8 (``--fp8-param-gather``) are gathered again in the
        parameters' dtype (collective over each such bucket's group)."""
        self.wait_param_sync()
        if self.param_sharding is not None:
            self.param_sharding.materialize()
            return
        self.regather_stale()

    def regather_stale(self) -> None:
        """Distributed optimizer, ``--fp8-param-gather``: gather again, in the parameters'
        dtype, every bucket whose fp8 weights were last gathered in fp8 (collective over
        each such bucket's group; nothing without such buckets)."""
        self.wait_param_sync()
        stale = [bk for buf in self.buffers for bk in buf.buckets
                 if bk.fp8_gather is not None and bk.fp8_gather.stale
                 and bk.param_shard is None]
        for bucket in stale:
            bucket.start_param_sync(plain=True)
        for bucket in stale:
            bucket.wait_param_sync()

    def wait_param_sync(self) -> None:
        """Wait for the all-gathers of :meth:`start_param_sync` still in flight (no
        collective of its own): what the optimizer needs before writing its shards."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                bucket.wait_param_sync()

    def remove_hooks(self) -> None:
        """Complete the parameter sync (full parameters again, also under
        ``shard_params``) and remove every hook: the model is a plain module after it."""
        self.finish_param_sync()
        if self.param_sharding is not None:
            self.param_sharding.remove()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- hooks -------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: fold ``param.grad`` into ``main_grad``; launch the
        bucket's reduction when overlapping and the gradient is final. A backward whose
        weight gradients are deferred (a zero-bubble B step, ``parallel.weight_grad``)
        runs the hook with no gradient: it arrives in the W step."""
        if param.grad is None:
            return
        chunk, b, bucket = self._where[id(param)]
        if bucket.grad_sync_launched:
            raise RuntimeError(
                f"a gradient arrived for a parameter of shape {tuple(param.shape)} after its "
                f"bucket's data-parallel reduction was launched (more backward passes than "
                f"announced: zero_grad(num_microbatches={self._expected}), last-micro-batch "
                f"flags {self._last}); call grads.set_last_microbatch(False) before non-last "
                "backward passes or announce the right number of micro-batches")
        if bucket.reduced_shard is not None:
            self._add_to_round(param, b, bucket)
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.overlap_grad_reduce:
            return
        count = self._arrivals[id(param)] = self._arrivals.get(id(param), 0) + 1
        if not (self._last[chunk] or (self._expected is not None and count == self._expected)):
            return
        self._record("grad-final", chunk, b, bucket.index)
        done = self._final[id(bucket)] = self._final.get(id(bucket), 0) + 1
        if done == len(bucket.params):
            self._launch_ready(self.buffers[b])

    def _add_to_round(self, param, b: int, bucket: Bucket) -> None:
        """``shard_grads``: add ``param.grad`` to its bucket's open round (opening one); once
        every parameter of the bucket has a gradient in it, reduce-scatter the round into
        the shard (collective over the bucket's group; waited for at once unless
        ``overlap_grad_reduce``). All ranks of the group close rounds in the same order:
        their backward passes produce the same gradients in the same order."""
        bucket.open_round()
        param.main_grad.add_(param.grad)
        param.grad = None
        bucket.round_arrivals.add(id(param))
        if len(bucket.round_arrivals) < len(bucket.params):
            return
        self._record("grad-round-start", self._where[id(param)][0], b, bucket.index)
        bucket.start_round()
        if not self.overlap_grad_reduce:
            bucket.wait_rounds()

    def _launch_ready(self, buf: GradBuffer) -> None:
        """Launch, in bucket order, every bucket of ``buf`` whose gradients are final."""
        nxt = self._next_launch.get(id(buf), 0)
        while nxt < len(buf.buckets):
            bucket = buf.buckets[nxt]
            if self._final.get(id(bucket), 0) < len(bucket.params):
                break
            if not bucket.grad_sync_launched:
                self._launch(bucket)
            nxt += 1
        self._next_launch[id(buf)] = nxt

    def _launch(self, bucket: Bucket) -> None:
        chunk, b, _ = self._where[id(bucket.params[0])]
        self._record("grad-sync-start", chunk, b, bucket.index)
        bucket.start_grad_sync()

    def _forward_waits_possible(self) -> bool:
        return all(isinstance(chunk, torch.nn.Module) for chunk in self.chunks)

    def _register_forward_waits(self) -> list:
        """A forward pre-hook on every module owning parameters: wait for their buckets."""
        if not self._forward_waits_possible():
            return []
        handles = []
        for c, chunk in enumerate(self.chunks):
            for module in chunk.modules():
                buckets = []
                for p in module.parameters(recurse=False):
                    where = self._where.get(id(p))
                    if where is not None and where[2] not in buckets:
                        buckets.append(where[2])
                if buckets:
                    handles.append(module.register_forward_pre_hook(
                        self._make_forward_wait(c, buckets)))
        return handles

    def _make_forward_wait(self, chunk: int, buckets: list):
        def wait(_module, _args):
            for bucket in buckets:
                if bucket.wait_param_sync():
                    b = self._where[id(bucket.params[0])][1]
                    self._record("param-sync-wait", chunk, b, bucket.index)
        return wait

    def _before_state_dict(self, *_args, **_kwargs) -> None:
        self.finish_param_sync()

    def _record(self, event: str, chunk: int, buffer: int, bucket: int) -> None:
        if self.trace is not None:
            self.trace.append((event, chunk, buffer, bucket))
