"""Contiguous gradient (and parameter) buffers of one model chunk, split into buckets.

One :class:`GradBuffer` holds the parameters of one model chunk that share a reduction
group and a dtype, laid out back to front (the order backward produces their gradients)::

    grad_data   [N]  fp32, or bf16 with --grad-reduce-in-bf16; param.main_grad are views
    param_data  [N]  the parameters' dtype, distributed optimizer only; the parameters
                     themselves become views into it (param.data = param_data[a:b].view(...))

A bucket holds whole parameters and at least ``bucket_size`` elements (the last one may be
smaller); a word embedding shared between pipeline stages (``param_meta(p).shared_embedding``)
gets a bucket of its own, so that the first and the last stage split it into identical
shards. Under the distributed optimizer every bucket is padded with zeros to a multiple
of the group size ``D`` and cut into ``D`` equal shards: rank ``r`` of ``group`` owns
elements ``[r * N_b / D, (r + 1) * N_b / D)`` of each bucket of ``N_b`` elements.

Collectives of a bucket, all on ``group`` (``ps.dp_cp`` for dense parameters, ``ps.edp``
for expert parameters), all asynchronous (``start_*`` launches, ``wait_*`` completes), all
through :mod:`megalite.parallel.collectives`:

- grad sync, plain: ``all_reduce`` (SUM) of the bucket's gradients, in place.
- grad sync, sharded: ``reduce_scatter`` (SUM) of the bucket's gradients into a fresh
  ``[N_b / D]`` tensor that :meth:`Bucket.wait_grad_sync` copies into this rank's shard
  of ``grad_data`` (elements outside the shard keep this rank's unreduced values). gloo
  supports ``reduce_scatter_single`` / ``all_gather_single`` on CPU (torch >= 2.x), so no
  all-reduce workaround is needed; input and output never alias.
- param sync (sharded only): ``all_gather`` of every rank's shard of ``param_data`` (sent
  from a copy) into the whole bucket.

Sharded gradients (``shard_grads``, ``--data-parallel-sharding-strategy optim_grads``, with
``D > 1``; ZeRO-2): no buffer holds the whole model's gradients. Each bucket allocates its
own zeroed ``[N_b]`` gradient (and its parameters' ``main_grad`` views) when the first
gradient of a round reaches it; a round ends when every parameter of the bucket has
received a gradient since the last one (once per micro-batch, for a fixed graph), and
then the bucket is reduce-scattered (SUM over ``group``) into a fresh ``[N_b / D]`` that is
added to this rank's persistent shard ``shard_grad_data`` ``[N / D]`` (bucket ``b``'s at
the sum of the earlier buckets' ``N_b / D``), and its full gradient is dropped
(:meth:`Bucket.start_round` / :meth:`Bucket.wait_rounds`). A rank holds ``4 N / D`` bytes
of fp32 gradients plus the buckets of the backward in flight, as under Megatron-FSDP,
at the cost of one reduce-scatter per bucket and micro-batch instead of one per step.
Between rounds a parameter has no ``main_grad`` attribute, so a stray read raises
AttributeError.
"""

from __future__ import annotations

import torch

from megalite.parallel import collectives
from megalite.parallel.params import param_meta
from megalite.parallel.state import Group


ROUNDS_IN_FLIGHT = 1
"""``shard_grads``: reduce-scatters of rounds a buffer leaves in flight when it launches
another (the backward computes the next bucket while the last one is reduced)."""


class Bucket:
    """A slice ``[start, end)`` of a :class:`GradBuffer` holding whole parameters.

    ``ranges[i] = (a, b)``: ``params[i]`` occupies bucket elements ``[a, b)``.
    ``grad`` / ``param`` are views of the buffer's ``grad_data`` / ``param_data``.
    """

    def __init__(self, buffer: GradBuffer, index: int, params: list, ranges: list,
                 start: int, end: int):
        self.buffer, self.index = buffer, index
        self.params, self.ranges = params, ranges
        self.start, self.end = start, end
        self.param = None if buffer.param_data is None else buffer.param_data[start:end]
        self._grad_work = None
        self._scattered = None
        self._param_work = None
        self.reduced_shard: torch.Tensor | None = None   # set by GradBuffer (shard_grads)
        self.param_shard: torch.Tensor | None = None     # set by GradBuffer (shard_params)
        self.grad_sync_launched = False
        # optim_grads_params (megalite.optim.param_sharding): units holding the gathered
        # ``param``, and the all-gather in flight into it
        self.gather_users = 0
        self.gather_work = None
        # --fp8-param-gather: the bucket holds weights of fp8 linears, gathered as fp8 bytes
        # (megalite.optim.fp8_param_gather.Fp8BucketGather), or None
        self.fp8_gather = None
        self.fp8_gathered = False     # optim_grads_params: the gather in flight / held is fp8
        # optim_grads_params: the StepWeights quantising this bucket's weights, told to
        # forget their copies when the bucket is freed
        self.step_weights: list = []
        # shard_grads: this round's full gradient [numel] (None between rounds), the ids of
        # the parameters that received a gradient in it, and the rounds being reduced
        self._own_grad: torch.Tensor | None = None
        self.round_arrivals: set = set()
        self._rounds: list = []

    @property
    def grad(self) -> torch.Tensor:
        """``[numel]``: the bucket's view of the buffer's ``grad_data``; under
        ``shard_grads`` this round's own gradient (:meth:`open_round`)."""
        if self.buffer.shard_grads:
            if self._own_grad is None:
                raise RuntimeError("this bucket has no gradient between rounds "
                                   "(optim_grads keeps only the reduced shard)")
            return self._own_grad
        return self.buffer.grad_data[self.start:self.end]

    # -- rounds of sharded gradients (shard_grads) -----------------------------------------
    @property
    def round_open(self) -> bool:
        return self._own_grad is not None

    def open_round(self) -> None:
        """A zeroed ``[numel]`` gradient for a new round and its parameters' ``main_grad``
        views into it (a no-op while a round is open)."""
        if self._own_grad is None:
            self._own_grad = torch.zeros(self.numel, dtype=self.buffer.grad_dtype,
                                         device=self.buffer.device)
            for p, (a, b) in zip(self.params, self.ranges):
                p.main_grad = self._own_grad[a:b].view(p.shape)

    def start_round(self) -> None:
        """Close the open round: launch the reduce-scatter (SUM over ``group``) of its
        gradient into a fresh ``[numel / D]`` without waiting and drop the ``main_grad``
        views. The buffer's rounds launched before complete first
        (:data:`ROUNDS_IN_FLIGHT`), so the backward holds in full at most the bucket it
        fills and the one being reduced."""
        grad = self.drop_round()
        in_flight = self.buffer.rounds_in_flight
        while len(in_flight) >= ROUNDS_IN_FLIGHT:
            in_flight.pop(0).wait_rounds()
        out = torch.empty(self.numel // self.group.size, dtype=grad.dtype, device=grad.device)
        work = collectives.reduce_scatter_tensor(out, grad, self.group, async_op=True)
        self._rounds.append((work, out, grad))
        in_flight.append(self)

    def drop_round(self) -> torch.Tensor | None:
        """End the open round without reducing it: drop the ``main_grad`` views and
        return its gradient (None if no round was open)."""
        grad, self._own_grad = self._own_grad, None
        self.round_arrivals.clear()
        for p in self.params:
            if hasattr(p, "main_grad"):
                del p.main_grad
        return grad

    def wait_rounds(self) -> None:
        """Complete the launched rounds, adding each reduced ``[numel / D]`` into
        ``reduced_shard`` (no collective of its own)."""
        for work, out, _grad in self._rounds:
            work.wait()
            self.reduced_shard.add_(out)
        self._rounds.clear()

    def round_tensors(self) -> list[torch.Tensor]:
        """The full gradients this bucket holds now (the open round's, those in flight)."""
        held = [] if self._own_grad is None else [self._own_grad]
        return held + [grad for _w, _o, grad in self._rounds]

    @property
    def group(self) -> Group:
        return self.buffer.group

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """Bucket elements ``[lo, hi)`` owned by ``rank`` (default: this rank) of the group;
        the whole bucket when the buffer is not sharded."""
        if not self.buffer.sharded:
            return 0, self.numel
        size = self.numel // self.group.size
        rank = self.group.rank if rank is None else rank
        return rank * size, (rank + 1) * size

    def shard_param(self) -> torch.Tensor:
        """``[hi - lo]``: this rank's shard of the bucket's parameters (the whole bucket when
        not sharded): a view of ``param``, or under ``shard_params`` the persistent shard,
        which stays valid while ``param`` is freed."""
        if self.param_shard is not None:
            return self.param_shard
        lo, hi = self.shard_range()
        return self.param[lo:hi]

    def shard_grad(self) -> torch.Tensor:
        """``[hi - lo]``: this rank's shard of the bucket's gradients (after the reduction:
        their SUM over ``group``); the whole bucket when not sharded."""
        if self.reduced_shard is not None:
            return self.reduced_shard
        lo, hi = self.shard_range()
        return self.grad[lo:hi]

    # -- gradients ------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Launch this bucket's SUM over ``group`` (all-reduce, or reduce-scatter when
        sharded) without waiting."""
        self.grad_sync_launched = True
        if self.group.size == 1:
            return
        if self.reduced_shard is not None:    # optim_grads: the open round, if any
            if self.round_open:
                self.start_round()
        elif self.buffer.sharded:
            self._scattered = torch.empty(self.numel // self.group.size,
                                          dtype=self.grad.dtype, device=self.grad.device)
            self._grad_work = collectives.reduce_scatter_tensor(self._scattered, self.grad,
                                                                self.group, async_op=True)
        else:
            self._grad_work = collectives.all_reduce_async(self.grad, self.group)

    def wait_grad_sync(self) -> None:
        """Complete the launched reduction (a no-op if none is in flight)."""
        if self.reduced_shard is not None:
            self.wait_rounds()
            return
        if self._grad_work is None:
            return
        self._grad_work.wait()
        self._grad_work = None
        if self._scattered is not None:
            lo, hi = self.shard_range()
            self.grad[lo:hi].copy_(self._scattered)
            self._scattered = None

    # -- parameters (distributed optimizer) ----------------------------------------------
    def start_param_sync(self, plain: bool = False) -> None:
        """Launch the all-gather of every rank's parameter shard into ``self.param`` (not
        under ``shard_params``: layers gather their own buckets when they need them). With
        an active ``fp8_gather`` (and not ``plain``) the fp8 linears' weights travel as fp8
        and their elements of ``param`` are left stale."""
        if self.group.size == 1 or self.param is None or self.param_shard is not None:
            return
        if self.fp8_gather is not None and not plain and self.fp8_gather.active:
            self._param_work = (self.fp8_gather.start(self.shard_param(), self.param), None)
            return
        if self.fp8_gather is not None:
            self.fp8_gather.stale = False
        lo, hi = self.shard_range()
        mine = self.param[lo:hi].clone()
        self._param_work = (collectives.all_gather_into_tensor(self.param, mine, self.group,
                                                               async_op=True), mine)

    def wait_param_sync(self) -> bool:
        """Complete the all-gather; True if one was in flight."""
        if self._param_work is None:
            return False
        self._param_work[0].wait()
        self._param_work = None
        return True


class GradBuffer:
    """Flat gradient (and, when ``sharded``, parameter) storage for ``params``.

    params:       this chunk's parameters of one group and dtype, in ``parameters()`` order.
    group:        the group their gradients are summed over.
    grad_dtype:   dtype of ``grad_data`` (and of every ``param.main_grad``).
    bucket_size:  minimum elements per bucket.
    sharded:      distributed optimizer: pad buckets to a multiple of ``group.size``, move
                  the parameters into ``param_data``.
    shard_grads:  (with ``sharded``) keep only this rank's shard of the reduced gradients
                  between steps (see module docstring); no effect when ``group.size`` is 1.
    shard_params: (with ``sharded``; implies ``shard_grads``) keep only this rank's shard of
                  the parameters; per-bucket full ``param`` gathered on demand (see module
                  docstring); no effect when ``group.size`` is 1.
    unit_of:      id(param) -> gather unit: a bucket never spans two units (any strategy).
    """

    def __init__(self, params: list, group: Group, grad_dtype: torch.dtype, bucket_size: int,
                 sharded: bool, device: torch.device, shard_grads: bool = False,
                 shard_params: bool = False, unit_of: dict | None = None):
        if (shard_grads or shard_params) and not sharded:
            raise ValueError("shard_grads / shard_params need sharded=True (the distributed "
                             "optimizer)")
        self.group, self.sharded = group, sharded
        self.shard_params = shard_params and group.size > 1
        self.shard_grads = (shard_grads or shard_params) and group.size > 1
        self.params = list(reversed(params))
        self.param_dtype = self.params[0].dtype
        spans = self._layout(self.params, bucket_size, group.size if sharded else 1, unit_of)
        total = spans[-1][2] if spans else 0
        self.total, self.grad_dtype, self.device = total, grad_dtype, device
        # under shard_grads no full buffer: each bucket's rounds hold their own gradients
        self.grad_data = torch.zeros(0 if self.shard_grads else total, dtype=grad_dtype,
                                     device=device)
        self.param_data = None
        if sharded and not self.shard_params:
            self.param_data = torch.zeros(total, dtype=self.param_dtype, device=device)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}   # id(param) -> bucket
        for index, (members, start, end) in enumerate(spans):
            ranges, offset = [], start
            for p in members:
                ranges.append((offset - start, offset - start + p.numel()))
                offset += p.numel()
            bucket = Bucket(self, index, members, ranges, start, end)
            if self.shard_params:    # a full copy of its own, freed and gathered per use
                bucket.param = torch.zeros(end - start, dtype=self.param_dtype, device=device)
            self.buckets.append(bucket)
            for p, (a, b) in zip(members, ranges):
                self.bucket_of[id(p)] = bucket
                if sharded:
                    with torch.no_grad():
                        bucket.param[a:b].copy_(p.detach().reshape(-1))
                    p.data = bucket.param[a:b].view(p.shape)
        self.shard_grad_data = None
        self.rounds_in_flight: list[Bucket] = []   # shard_grads, oldest first
        if self.shard_grads:
            self.shard_grad_data = torch.zeros(total // group.size, dtype=grad_dtype,
                                               device=device)
            offset = 0
            for bucket in self.buckets:
                n = bucket.numel // group.size
                bucket.reduced_shard = self.shard_grad_data[offset:offset + n]
                offset += n
        else:
            self._attach_main_grads()
        self.shard_param_data = None
        if self.shard_params:
            self.shard_param_data = torch.empty(total // group.size, dtype=self.param_dtype,
                                                device=device)
            offset = 0
            for bucket in self.buckets:
                n = bucket.numel // group.size
                bucket.param_shard = self.shard_param_data[offset:offset + n]
                lo, hi = bucket.shard_range()
                bucket.param_shard.copy_(bucket.param[lo:hi])
                offset += n

    def _attach_main_grads(self) -> None:
        """``param.main_grad``: a view of ``grad_data`` in the parameter's shape."""
        for bucket in self.buckets:
            grad = bucket.grad
            for p, (a, b) in zip(bucket.params, bucket.ranges):
                p.main_grad = grad[a:b].view(p.shape)

    def round_tensors(self) -> list[torch.Tensor]:
        """``shard_grads``: the buckets' full gradients held now (open or in flight)."""
        return [t for bucket in self.buckets for t in bucket.round_tensors()]

    @staticmethod
    def _layout(params: list, bucket_size: int, pad_to: int, unit_of: dict | None = None
                ) -> list[tuple[list, int, int]]:
        """``[(params, start, end), ...]``: bucket members and element range (padded)."""
        spans, members, start, offset = [], [], 0, 0
        unit_of = unit_of or {}

        def close():
            nonlocal members, start, offset
            if members:
                end = start + -(-(offset - start) // pad_to) * pad_to
                spans.append((members, start, end))
                members, start, offset = [], end, end

        for p in params:
            alone = param_meta(p).shared_embedding
            if alone or (members and unit_of.get(id(p)) != unit_of.get(id(members[-1]))):
                close()
            members.append(p)
            offset += p.numel()
            if alone or offset - start >= bucket_size:
                close()
        close()
        return spans

    def zero_(self) -> None:
        """Zero the gradients for a new step (under ``shard_grads`` the reduced shards;
        a round still open or in flight from an abandoned step is dropped)."""
        if self.shard_grads:
            self.rounds_in_flight.clear()
            for bucket in self.buckets:
                bucket.wait_rounds()
                bucket.drop_round()
            self.shard_grad_data.zero_()
        else:
            self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.grad_sync_launched = False

    def __repr__(self) -> str:
        return (f"GradBuffer({len(self.params)} params, {self.grad_data.numel()} elements, "
                f"{len(self.buckets)} buckets, group {self.group.name} x{self.group.size}, "
                f"{'sharded' if self.sharded else 'replicated'}"
                f"{', gradients sharded' if self.shard_grads else ''}"
                f"{', parameters sharded' if self.shard_params else ''})")
