"""``--fp8-param-gather``: the parameter all-gather of the distributed optimizer (and of
ZeRO-3's per-layer gathers) sends the weights of fp8 linears as fp8 bytes.

A sharded bucket (:mod:`megalite.optim.grad_buffer`) of ``N_b`` elements is cut into ``D``
equal shards over ``bucket.group`` (``ps.dp_cp``). Without this flag each rank sends its
shard in the parameters' dtype (``2 N_b / D`` bytes for bf16). With it, each element of
the shard that belongs to the weight of a per-tensor fp8 linear (tensorwise or delayed;
:class:`~megalite.layers.fp8.scaling.Fp8Scaling`) is sent as one fp8 byte, quantised on
the rank that owns it, and every other element (norms, biases, embeddings, the output
layer, bf16 layers) in the parameters' dtype. Each rank packs its shard as one ``uint8``
row ``[B]`` (its plain elements first, in bucket order, then its fp8 bytes; ``B`` the
largest rank's packed size rounded up to 8) and one ``all_gather_into_tensor`` of
``[D * B]`` bytes runs over ``bucket.group``.

Scales are the one-process run's (:meth:`Fp8Scaling.weight_fp8` quantises the whole weight
``[N/tp, K]`` or ``[N, K/tp]`` once per step):

- **tensorwise**: each rank takes the amax of its piece of every fp8 weight of the bucket
  (0 for none), reduces them (MAX) over ``bucket.group`` and then over the weight's own
  groups (``scaling.groups[WEIGHT]``: ``ps.tp``), so every owner quantises its piece with
  the scale of the whole weight;
- **delayed**: the scale of the history (no reduction); the piece's amax is recorded in
  ``step_amax``, whose MAX over ``ps.tp`` and ``ps.dp_cp`` at the end of the step is the
  whole weight's.

After the gather, each rank holds the fp8 weight ``[N/tp, K]`` (or ``[N, K/tp]``) and hands
``(scale, fp8 weight)`` to the linear's scaling (:meth:`Fp8Scaling.give_weight`), which uses
it for every forward of the step instead of quantising the weight itself. The high
precision copies of these weights are then not gathered: under the distributed optimizer
their elements of ``param_data`` keep older values (:attr:`Fp8BucketGather` marks the
bucket ``stale``; ``DataParallelGrads.finish_param_sync`` gathers them in the parameters'
dtype before anything reads parameters: a checkpoint, evaluation, the end of training);
under ZeRO-3 the weights point at the NaN placeholder while their unit is gathered.

ZeRO-3 gathers a unit before every forward and backward of the step, each time in fp8
(the scalings' fp8 weights, like the unit's other parameters, are forgotten when the unit
is freed: :mod:`megalite.optim.param_sharding`). The shards and scales do not change within
a step, so each rank quantises and packs its row once per step and sends the same row at
every later gather (no scales, no amax collectives, no quantisation again); the row is
packed again once a scaling's step ended (``StepWeights.steps``,
:mod:`megalite.layers.fp8.scaling`: the optimizer is about to change the shards, the delayed
histories moved) or the shards were written otherwise (:meth:`Fp8BucketGather.forget_row`,
from ``ParamSharding.invalidate`` / ``write_back``: a load). Every rank of
``bucket.group`` sees the same steps and calls, so all take the same branch (the scales'
collectives run on all or none). Only training forwards use the fp8 gather; evaluation gathers
as without the flag. The fp32 masters (and so checkpoints) are unchanged.
"""

from __future__ import annotations

import torch

from megalite.layers.fp8.recipes import amax_of, dequant_scale, quantize
from megalite.layers.fp8.scaling import WEIGHT, Fp8Scaling
from megalite.parallel import collectives
from megalite.parallel.collectives import ReduceOp

ALIGN = 8      # bytes: each rank's row starts where any parameter dtype may be viewed


def fp8_weight_scalings(chunks) -> dict[int, Fp8Scaling]:
    """``id(weight) -> scaling`` of every linear in ``chunks`` whose weight enters a
    per-tensor fp8 GEMM (block recipes quantise per GEMM and are not gathered in fp8)."""
    out = {}
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            continue
        for module in chunk.modules():
            scaling = getattr(module, "fp8_scaling", None)
            weight = getattr(module, "weight", None)
            if isinstance(scaling, Fp8Scaling) and scaling.recipe.block is None \
                    and isinstance(weight, torch.nn.Parameter):
                out[id(weight)] = scaling
    return out


class Fp8BucketGather:
    """The fp8 all-gather of one sharded bucket (module docstring). ``members``: ``(param,
    a, b, scaling)`` for every parameter of the bucket, ``scaling`` None for those gathered
    in their dtype. ``stale``: the bucket's fp8 weights were last gathered in fp8, so their
    elements of ``bucket.param`` are out of date."""

    def __init__(self, bucket, scalings: dict[int, Fp8Scaling]):
        self.bucket = bucket
        self.members = [(p, a, b, scalings.get(id(p)))
                        for p, (a, b) in zip(bucket.params, bucket.ranges)]
        self.fp8 = [m for m in self.members if m[3] is not None]
        self.stale = False
        self.itemsize = torch.empty(0, dtype=bucket.buffer.param_dtype).element_size()
        # each rank's (plain, fp8) segments: fixed by the bucket, read at every gather
        self.segments = [self._segments(r) for r in range(bucket.group.size)]
        self.row_bytes = max(self.packed_bytes(r) for r in range(bucket.group.size))
        self.row_bytes = -(-self.row_bytes // ALIGN) * ALIGN
        # this rank's packed row and scales, kept while the shard and the step stay the same
        self._packed: tuple | None = None      # (key, row, scale_of)

    def _segments(self, rank: int) -> tuple[list, list]:
        """(plain, fp8) segments ``(member, s, e)`` of ``rank``'s shard, in bucket order."""
        lo, hi = self.bucket.shard_range(rank)
        plain, fp8 = [], []
        for m in self.members:
            s, e = max(m[1], lo), min(m[2], hi)
            if s < e:
                (plain if m[3] is None else fp8).append((m, s, e))
        return plain, fp8

    def packed_bytes(self, rank: int) -> int:
        """Bytes ``rank`` sends: its plain elements at the dtype's size, its fp8 ones at 1."""
        plain, fp8_segments = self.segments[rank]
        return (sum(e - s for _, s, e in plain) * self.itemsize
                + sum(e - s for _, s, e in fp8_segments))

    @property
    def active(self) -> bool:
        """Gather in fp8 now: some fp8 weight's linear is training (evaluation gathers the
        parameters in their dtype)."""
        return any(m[3].training for m in self.fp8)

    def _scales(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """The dequantisation scale (0-d fp32) of each fp8 member: tensorwise from the whole
        weight's amax (MAX over ``bucket.group``, then over each weight's own groups),
        delayed from its history (recording this rank's piece's amax)."""
        lo, hi = self.bucket.shard_range()
        pieces = [shard[max(a, lo) - lo:max(min(b, hi), lo) - lo] for _, a, b, _ in self.fp8]
        amax = torch.stack([amax_of(x) for x in pieces]) if pieces else None
        current = [i for i, m in enumerate(self.fp8) if not m[3].delayed]
        if current:
            sub = amax[current].clone()
            if self.bucket.group.size > 1:
                collectives.all_reduce(sub, self.bucket.group, ReduceOp.MAX)
            by_groups: dict[tuple, list[int]] = {}
            for j, i in enumerate(current):
                by_groups.setdefault(tuple(id(g) for g in self.fp8[i][3].groups[WEIGHT]),
                                     []).append(j)
            for idx in by_groups.values():   # the same order on every rank
                part = sub[idx].clone()
                for group in self.fp8[current[idx[0]]][3].groups[WEIGHT]:
                    collectives.all_reduce(part, group, ReduceOp.MAX)
                sub[idx] = part
        scales = []
        for i, (_, _, _, scaling) in enumerate(self.fp8):
            dtype = scaling.recipe.forward_dtype
            if scaling.delayed:
                if scaling.training:
                    scaling.step_amax[WEIGHT] = torch.maximum(scaling.step_amax[WEIGHT],
                                                              amax[i])
                scales.append(dequant_scale(scaling.history_amax()[WEIGHT], dtype,
                                            scaling.recipe.margin))
            else:
                scales.append(dequant_scale(sub[current.index(i)], dtype,
                                            scaling.recipe.margin))
        return scales

    @torch.no_grad()
    def _row(self, shard: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """This rank's packed row ``[row_bytes]`` (uint8) and ``id(weight) -> scale``: made
        (scales, quantisation) at the step's first gather and, under ZeRO-3, reused by the
        step's later gathers (module docstring; the distributed optimizer gathers once a
        step and keeps nothing)."""
        key = tuple(m[3].steps for m in self.fp8)
        if self._packed is not None and self._packed[0] == key:
            return self._packed[1], self._packed[2]
        lo, _ = self.bucket.shard_range()
        plain, fp8 = self.segments[self.bucket.group.rank]
        scale_of = {id(m[0]): d for m, d in zip(self.fp8, self._scales(shard))}
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=shard.device)
        at = 0
        for _, s, e in plain:
            n = (e - s) * self.itemsize
            row[at:at + n] = shard[s - lo:e - lo].contiguous().view(torch.uint8)
            at += n
        for (p, _, _, scaling), s, e in fp8:
            q = quantize(shard[s - lo:e - lo], scale_of[id(p)], scaling.recipe.forward_dtype)
            row[at:at + e - s] = q.view(torch.uint8)
            at += e - s
        if self.bucket.buffer.shard_params:   # ZeRO-3 gathers again within the step
            self._packed = (key, row, scale_of)
        return row, scale_of

    def forget_row(self) -> None:
        """The shard was written (a load): pack it again at the next gather."""
        self._packed = None

    def start(self, shard: torch.Tensor, full: torch.Tensor):
        """Launch the all-gather (asynchronous, over ``bucket.group``) of every rank's
        packed row of ``shard`` (``[N_b / D]``, this rank's shard of the bucket: its fp8
        pieces quantised, :meth:`_row`) into ``full`` (``[N_b]``, the plain elements) and
        per-weight fp8 tensors; the returned handle's ``wait()`` unpacks and gives each
        scaling its fp8 weight."""
        row, scale_of = self._row(shard)
        out = torch.empty(self.bucket.group.size * self.row_bytes, dtype=torch.uint8,
                          device=shard.device)
        work = collectives.all_gather_into_tensor(out, row, self.bucket.group, async_op=True)
        return _Fp8Work(self, work, out, full, scale_of)

    def unpack(self, out: torch.Tensor, full: torch.Tensor, scale_of: dict) -> None:
        """Every rank's row of ``out`` into ``full`` (plain elements) and the fp8 weights;
        each fp8 weight's scaling gets ``(scale, fp8 weight)`` (until the step ends, or
        under ZeRO-3 until the unit is freed)."""
        dtype = full.dtype
        weights = {id(m[0]): torch.empty(m[2] - m[1], dtype=m[3].recipe.forward_dtype,
                                         device=out.device) for m in self.fp8}
        for r in range(self.bucket.group.size):
            base = r * self.row_bytes
            plain, fp8 = self.segments[r]
            for _, s, e in plain:
                n = (e - s) * self.itemsize
                full[s:e] = out[base:base + n].view(dtype)
                base += n
            for (p, a, _, scaling), s, e in fp8:
                weights[id(p)][s - a:e - a] = out[base:base + e - s].view(
                    scaling.recipe.forward_dtype)
                base += e - s
        for p, _, _, scaling in self.fp8:
            if scaling.training:
                scaling.give_weight(scale_of[id(p)], weights[id(p)].view(p.shape))
        self.stale = True


class _Fp8Work:
    """The handle of one fp8 bucket gather: ``wait()`` completes it and unpacks."""

    def __init__(self, gather: Fp8BucketGather, work, out, full, scale_of):
        self.gather, self.work, self.out, self.full, self.scale_of = (
            gather, work, out, full, scale_of)

    def wait(self) -> bool:
        self.work.wait()
        self.gather.unpack(self.out, self.full, self.scale_of)
        return True


def attach(buffers, chunks) -> int:
    """Give every sharded bucket of ``buffers`` holding an fp8 weight of ``chunks`` its
    :class:`Fp8BucketGather` (``bucket.fp8_gather``); returns how many buckets got one."""
    scalings = fp8_weight_scalings(chunks)
    count = 0
    for buf in buffers:
        if not buf.sharded or buf.group.size == 1:
            continue
        for bucket in buf.buckets:
            if any(id(p) in scalings for p in bucket.params):
                bucket.fp8_gather = Fp8BucketGather(bucket, scalings)
                count += 1
    return count
