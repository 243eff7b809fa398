"""Parameter sharding (ZeRO-3, ``--data-parallel-sharding-strategy optim_grads_params``):
each layer's parameters are all-gathered just before its forward and again before its
backward, and freed after each.

Storage (:mod:`megalite.optim.grad_buffer`, ``shard_params``): a rank keeps its shard of
every bucket (``bucket.param_shard``, ``[N_b / D]``, persistent; the optimizer steps it) and
each bucket has a full ``bucket.param`` ``[N_b]`` whose storage exists only while some
unit uses it. ``D`` is the bucket's group: ``ps.dp_cp`` for dense parameters, ``ps.edp``
for expert parameters. Buckets never span two units, and the element layout is the one of
``optim`` / ``optim_grads``, so gradients (reduce-scattered into ``reduced_shard`` exactly
as under ``optim_grads``), optimizer pieces and checkpoints are unchanged.

Units (:func:`find_units`): per model chunk, the embedding, each transformer layer, the
final norm and the output layer (which also *uses* the word embedding when the two are tied
on one stage); parameters of no such module form one unit around the whole chunk. A unit is
gathered while it holds a reason (``forward``, ``backward``, ``prefetch``, ``materialized``);
a bucket is gathered while a unit holding it does (a count, ``bucket.gather_users``).

* gather: ``resize_`` the bucket's storage back, launch ``all_gather_into_tensor`` of every
  rank's shard into it over the bucket's group (asynchronous); waiting for it points the
  parameters (``p.data``) at their views of it.
* free: the parameters point at a one-element NaN placeholder expanded to their shape (a
  stray read gives NaN, which the loss check reports; an in-place write raises), the
  bucket's storage is resized to 0, and the fp8 copies of its weights
  (:class:`~megalite.layers.fp8.scaling.StepWeights`) are forgotten: like the weights,
  they exist only while their unit is gathered, and are made again after its next
  gather. Autograd's saved views of a weight keep the storage
  object, which the gather before backward refills, so backward reads gathered values.

Hooks, per unit module:

* forward pre-hook: hold ``forward``, wait for the gather; prefetch the next unit (its
  gather overlaps this unit's compute); register a hook on each input tensor that requires
  grad: its gradient is complete once this unit's backward is done -> drop ``backward``.
* forward hook: register a hook on the output's gradient (runs before this unit's backward:
  hold ``backward``, drop the next unit's ``backward`` (the gradient of its input is
  complete), wait, prefetch the previous unit); drop ``forward``.
* at the end of each backward (an autograd engine callback): drop every ``backward`` and
  ``prefetch`` hold left (the embedding, whose input has no gradient).

``--fp8-param-gather``: a bucket holding weights of fp8 linears
(``bucket.fp8_gather``) is gathered for a training forward or backward with those weights
as fp8 bytes (:mod:`megalite.optim.fp8_param_gather`), handed to their linears' scalings;
the weights themselves stay the placeholder. :meth:`ParamSharding.materialize` gathers
every parameter in its dtype.

Activation recomputation re-runs forwards inside backward: those gather what they need and
register nothing; a unit held for its backward stays gathered through its recompute.

Between steps only the shards are held: ``(2 + 4 + 12) / D`` bytes per parameter for bf16
parameters, fp32 gradients and Adam, plus the gathered units while a forward or backward
runs: at most two neighbouring units (the current one and the prefetched one; the output
layer's include the tied word embedding).
:meth:`ParamSharding.materialize` gathers everything (to read parameters, e.g. to save a
checkpoint); the next forward frees it unit by unit; :meth:`ParamSharding.invalidate` drops
every gathered copy after the optimizer updated the shards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from megalite.parallel import collectives

FORWARD, BACKWARD, PREFETCH, MATERIALIZED = "forward", "backward", "prefetch", "materialized"
_REASONS = (FORWARD, BACKWARD, PREFETCH, MATERIALIZED)


@dataclass(eq=False)
class Unit:
    """What is gathered together: ``params`` (trainable parameters of ``module`` that no
    earlier unit owns; their buckets hold nothing else) and ``uses`` (parameters owned by
    another unit that this one reads too: the tied output weight)."""

    name: str
    module: torch.nn.Module
    params: list
    uses: list = field(default_factory=list)
    buckets: list = field(default_factory=list)      # sharded buckets of params + uses
    holds: set = field(default_factory=set)
    whole_chunk: bool = False       # the chunk's leftover parameters, around its forward
    next: Unit | None = None        # the unit whose input is this one's output
    prev: Unit | None = None

    def __repr__(self) -> str:
        return f"Unit({self.name}, {len(self.params)} params, holds {sorted(self.holds)})"


def find_units(chunk: torch.nn.Module) -> list[Unit]:
    """The gather units of one model chunk, in forward order (see module docstring). A
    GPTModel chunk (``embedding`` or ``mtp_embedding``, ``decoder.layers``,
    ``decoder.final_layernorm``, ``output_layer``) gets one unit per such module; any other
    module is one unit."""
    units: list[Unit] = []
    owned: set[int] = set()

    def add(name: str, module: torch.nn.Module | None, uses: list | None = None) -> None:
        if module is None:
            return
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in owned]
        owned.update(id(p) for p in params)
        if params or uses:
            units.append(Unit(name, module, params, list(uses or [])))

    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleDict):
        add("embedding", getattr(chunk, "embedding", None))
        # a V schedule's output chunk: the prediction depths' copy of the word embedding
        add("mtp_embedding", getattr(chunk, "mtp_embedding", None))
        for key, layer in layers.items():
            add(f"decoder.layers.{key}", layer)
        add("decoder.final_layernorm", getattr(decoder, "final_layernorm", None))
        out = getattr(chunk, "output_layer", None)
        uses = []
        if out is not None and getattr(out, "weight", None) is None \
                and hasattr(chunk, "output_weight"):
            uses = [chunk.output_weight()]       # the tied word embedding of this chunk
        add("output_layer", out, uses)
    rest = [p for p in chunk.parameters() if p.requires_grad and id(p) not in owned]
    if rest:   # around the whole chunk, gathered first
        units.insert(0, Unit("(chunk)", chunk, rest, whole_chunk=True))
    return units


def _step_weights_of(units: list[list[Unit]]) -> dict[int, list]:
    """``id(parameter) -> [StepWeights]``: the modules keeping quantised copies of the
    parameter through a step (:class:`megalite.layers.fp8.scaling.StepWeights`, a child of
    the module whose own parameter it quantises: an fp8 linear's scaling, the routed
    experts' fp8 weights)."""
    from megalite.layers.fp8.scaling import StepWeights

    out: dict[int, list] = {}
    for chunk_units in units:
        for unit in chunk_units:
            for owner in unit.module.modules():
                kept = [c for c in owner.children() if isinstance(c, StepWeights)]
                for p in owner.parameters(recurse=False) if kept else ():
                    out.setdefault(id(p), []).extend(kept)
    return out


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _in_backward() -> bool:
    """Inside the autograd engine: a recompute of activation checkpointing."""
    return torch._C._current_graph_task_id() != -1


class ParamSharding:
    """Gathers and frees the sharded buckets of ``units`` (one list per chunk, from
    :func:`find_units`) around their forward and backward (see module docstring).

    Starts with every parameter gathered (``materialized``: the model was built whole);
    the first forward frees them unit by unit. ``gathered_bytes`` / ``peak_gathered_bytes``:
    bytes of full bucket copies held now / at most since :meth:`reset_peak`. ``trace``: set
    to a list to record ``(event, unit name)`` for ``gather`` and ``free``.
    """

    def __init__(self, units: list[list[Unit]], buffers: list, prefetch: bool = True):
        self.prefetch = prefetch
        self.trace: list | None = None
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self._placeholders: dict = {}
        self._callback_task = None
        bucket_of = {id(p): bucket for buf in buffers if buf.shard_params
                     for bucket in buf.buckets for p in bucket.params}
        copies = _step_weights_of(units)
        for bucket in set(bucket_of.values()):
            bucket.step_weights = list({id(sw): sw for p in bucket.params
                                        for sw in copies.get(id(p), ())}.values())
            for sw in bucket.step_weights:
                sw.freed_between_passes = True
        self.units: list[Unit] = []
        self._handles = []
        for chunk_units in units:
            active = []
            for unit in chunk_units:
                for p in unit.params + unit.uses:
                    bucket = bucket_of.get(id(p))
                    if bucket is not None and bucket not in unit.buckets:
                        unit.buckets.append(bucket)
                if unit.buckets:
                    active.append(unit)
            chain = [u for u in active if not u.whole_chunk]
            for a, b in zip(chain, chain[1:]):    # each one's output is the next one's input
                a.next, b.prev = b, a
            for unit in active:
                self._handles += [
                    unit.module.register_forward_pre_hook(
                        functools.partial(self._before_forward, unit), with_kwargs=True),
                    unit.module.register_forward_hook(
                        functools.partial(self._after_forward, unit))]
            self.units += active
        for unit in self.units:        # built whole: every bucket is gathered already
            unit.holds.add(MATERIALIZED)
            for bucket in unit.buckets:
                if bucket.gather_users == 0:
                    self._count(bucket, +1)
                bucket.gather_users += 1

    # -- buckets ------------------------------------------------------------------------
    def _count(self, bucket, sign: int) -> None:
        self.gathered_bytes += sign * bucket.param.numel() * bucket.param.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.dtype, p.device)
        if key not in self._placeholders:
            self._placeholders[key] = torch.full((1,), float("nan"), dtype=p.dtype,
                                                 device=p.device)
        return self._placeholders[key].expand(p.shape)

    def _start_gather(self, bucket, fp8: bool = True) -> None:
        """Allocate the bucket's full storage and launch the all-gather of every rank's
        shard into it (asynchronous, over ``bucket.group``); with ``fp8`` and an active
        ``bucket.fp8_gather`` (``--fp8-param-gather``, training) the fp8 linears' weights
        travel as fp8 and go to their scalings, their parameters stay placeholders."""
        full = bucket.param
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self._count(bucket, +1)
        if fp8 and bucket.fp8_gather is not None and bucket.fp8_gather.active:
            bucket.gather_work = bucket.fp8_gather.start(bucket.param_shard, full)
            bucket.fp8_gathered = True
            return
        bucket.fp8_gathered = False
        bucket.gather_work = collectives.all_gather_into_tensor(
            full, bucket.param_shard, bucket.group, async_op=True) or _DONE

    def _wait_gather(self, bucket) -> None:
        """Complete the bucket's all-gather; the parameters become views of it."""
        if bucket.gather_work is None:
            return
        bucket.gather_work.wait()
        bucket.gather_work = None
        fp8 = {id(m[0]) for m in bucket.fp8_gather.fp8} if bucket.fp8_gathered else ()
        for p, (a, b) in zip(bucket.params, bucket.ranges):
            p.data = (self._placeholder(p) if id(p) in fp8
                      else bucket.param[a:b].view(p.shape))

    def _free(self, bucket) -> None:
        self._wait_gather(bucket)     # never leave a collective writing into freed memory
        for p in bucket.params:
            p.data = self._placeholder(p)
        for copies in bucket.step_weights:   # fp8 copies live while their unit is gathered
            copies.forget_weight()
        bucket.param.untyped_storage().resize_(0)
        self._count(bucket, -1)

    # -- units ----------------------------------------------------------------------------
    def _hold(self, unit: Unit, reason: str) -> None:
        if not unit.holds:
            self._record("gather", unit)
            for bucket in unit.buckets:
                bucket.gather_users += 1
                if bucket.gather_users == 1:   # materialize: every weight in its dtype
                    self._start_gather(bucket, fp8=reason != MATERIALIZED)
        unit.holds.add(reason)

    def _drop(self, unit: Unit, *reasons: str) -> None:
        if not unit.holds:
            return
        unit.holds.difference_update(reasons)
        if not unit.holds:
            self._record("free", unit)
            for bucket in unit.buckets:
                bucket.gather_users -= 1
                if bucket.gather_users == 0:
                    self._free(bucket)

    def _ready(self, unit: Unit) -> None:
        for bucket in unit.buckets:
            self._wait_gather(bucket)

    def _record(self, event: str, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append((event, unit.name))

    # -- hooks ----------------------------------------------------------------------------
    def _before_forward(self, unit: Unit, _module, args, kwargs):
        recompute = _in_backward()
        self._hold(unit, FORWARD)
        self._drop(unit, PREFETCH, MATERIALIZED)
        self._ready(unit)
        if self.prefetch and not recompute and unit.next is not None \
                and not unit.next.holds:
            self._hold(unit.next, PREFETCH)
        if torch.is_grad_enabled() and not recompute:
            after = functools.partial(self._after_backward, unit)
            for t in _tensors(args) + _tensors(kwargs):
                if t.requires_grad and not isinstance(t, torch.nn.Parameter):
                    t.register_hook(after)
        return None

    def _after_forward(self, unit: Unit, _module, _args, output):
        if torch.is_grad_enabled() and not _in_backward():
            outs = [t for t in _tensors(output) if t.requires_grad]
            before = functools.partial(self._before_backward, unit)
            if len(outs) == 1:
                outs[0].register_hook(before)
            elif outs:
                torch.autograd.graph.register_multi_grad_hook(outs, before, mode="any")
        self._drop(unit, FORWARD)
        return None

    def _before_backward(self, unit: Unit, _grad) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:   # once per backward pass
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._hold(unit, BACKWARD)
        self._drop(unit, PREFETCH, MATERIALIZED)
        if unit.next is not None:   # its input's gradient is complete: its backward is done
            self._drop(unit.next, BACKWARD)
        self._ready(unit)
        if self.prefetch and unit.prev is not None and not unit.prev.holds:
            self._hold(unit.prev, PREFETCH)

    def _after_backward(self, unit: Unit, _grad) -> None:
        self._drop(unit, BACKWARD)

    def _end_backward(self) -> None:
        self._callback_task = None
        for unit in self.units:
            self._drop(unit, BACKWARD, PREFETCH)

    # -- whole-model operations -------------------------------------------------------------
    def materialize(self) -> None:
        """Gather every parameter (collective over each bucket's group, every rank in the
        same order); they stay gathered until their unit's next forward."""
        for unit in self.units:
            self._hold(unit, MATERIALIZED)
        for unit in self.units:
            self._ready(unit)

    def invalidate(self) -> None:
        """Free every gathered copy (after the optimizer updated the shards, or a load)."""
        for unit in self.units:
            self._drop(unit, *_REASONS)
        self._forget_fp8_rows()

    def _forget_fp8_rows(self) -> None:
        """``--fp8-param-gather``: the shards changed, each bucket packs its row again."""
        for unit in self.units:
            for bucket in unit.buckets:
                if bucket.fp8_gather is not None:
                    bucket.fp8_gather.forget_row()

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's range of every gathered bucket into its shard (after loading
        weights into the gathered parameters)."""
        for unit in self.units:
            for bucket in unit.buckets:
                if bucket.gather_users:
                    self._wait_gather(bucket)
                    lo, hi = bucket.shard_range()
                    bucket.param_shard.copy_(bucket.param[lo:hi])
        self._forget_fp8_rows()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Done:
    """The work handle of a gather that completed at once (a group of one)."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()
