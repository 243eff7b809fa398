"""The distributed optimizer: fp32 main parameters and optimizer state sharded over data
parallelism (ZeRO stage 1, with stage 2's reduce-scattered gradients).

It works on the buffers of a :class:`~megalite.optim.data_parallel.DataParallelGrads`
built with ``use_distributed_optimizer=True``: the model's parameters are views into
``param_data``, every bucket is padded to a multiple of the group size ``D`` (``ps.dp_cp``
for dense, ``ps.edp`` for expert buffers) and rank ``r`` owns the ``r``-th ``1/D`` of each
bucket. A parameter may straddle shards; each rank keeps a *piece* per parameter that
intersects its shard: a 1-D fp32 view ``[n]`` of its shard master, on which the wrapped
torch optimizer (AdamW or SGD, element-wise, so sharding changes no arithmetic) keeps its
state. Per rank that is, for ``P`` parameters of this rank's model-parallel slice,
``4 P / D`` bytes of fp32 masters (none for fp32 training: the shard of the model's own
parameters is the master) and ``8 P / D`` of Adam moments.

A step, after :meth:`DataParallelGrads.finish_grad_sync` left the SUM of the gradients in
this rank's shard of ``grad_data``:

1. unscale the shard's gradients by ``1 / loss_scale``; any inf/nan on any rank (MAX over
   the world) skips the step;
2. norm: each rank sums the squares of its shard (model-parallel counting rules of
   :mod:`megalite.optim.clip_grads`), one SUM over the world (= dp x tp x pp); clip;
3. update the pieces, copy the shard masters into the shard of ``param_data`` (cast);
4. :meth:`DataParallelGrads.start_param_sync`: all-gather every bucket over its group,
   blocking, or overlapped with the next forward under ``--overlap-param-gather``.

``--data-parallel-sharding-strategy optim_grads`` changes only where the reduced gradients
live (a shard buffer of their own, the full buffer dropped between steps:
:mod:`megalite.optim.grad_buffer`); pieces read them through ``bucket.shard_grad()``.
``optim_grads_params`` also keeps the parameters as shards (``bucket.shard_param()``, the
same element range; :mod:`megalite.optim.param_sharding` gathers them per layer): step 3
writes the shard, and step 4 only drops the gathered copies the update made stale.

CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction F``): whole pieces,
first to last, until at least ``F`` of this rank's shard elements, keep their fp32 master
and state in host memory (pinned under CUDA; on a CPU-only run host and device are the
same and the same code runs): each step copies their gradients into a host buffer, a
second torch optimizer (``host_inner``) steps them on the CPU, and the masters are copied
back (cast) into the shard of ``param_data`` before the all-gather. The per-element
arithmetic is the same, so the run is bitwise the non-offloaded one on CPU (on a GPU, up
to the fused CUDA Adam kernel's rounding against the CPU's).

Checkpoints: :meth:`state_dict_per_param` all-gathers the shards (collective over each
buffer's group) into full tensors per parameter; :meth:`load_state_dict_per_param` keeps
this rank's slices (no collective), so it loads state saved with any dp size.
:meth:`state_dict` wraps the per-parameter form and is therefore collective too: every
rank must call it, even those that do not write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalite.config import OptimConfig
from megalite.optim.clip_grads import clip_coefficient, sharded_grad_norm
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.grad_buffer import Bucket
from megalite.optim.algorithms import algorithm_of
from megalite.optim.muon_layout import OwnerExchange
from megalite.optim.optimizer import (
    LossScaledOptimizer,
    StepOutcome,
    build_torch_optimizer,
    param_groups,
    rule_function,
)
from megalite.optim.optimizer_state import (
    init_state,
    keys_by_name,
    named_trainable_params,
    per_param_from_torch,
    set_state,
    state_tensor,
)
from megalite.parallel import collectives
from megalite.parallel.device import host_memory_pinned
from megalite.parallel.state import ParallelState


@dataclass
class _Piece:
    """Bucket elements ``[lo, hi)`` of ``param`` (starting at element ``start`` of the
    flattened parameter) that this rank owns; ``master`` is its fp32 ``[hi - lo]`` view,
    in host memory when ``host_grad`` (its ``[hi - lo]`` host copy of the gradient) is set."""

    name: str
    param: torch.nn.Parameter
    bucket: Bucket
    lo: int
    hi: int
    start: int
    master: torch.Tensor
    host_grad: torch.Tensor | None = None

    @property
    def host(self) -> bool:
        return self.host_grad is not None

    @property
    def grad(self) -> torch.Tensor:
        """``[hi - lo]``: the reduced gradient, where the bucket keeps this rank's shard."""
        first = self.bucket.shard_range()[0]
        return self.bucket.shard_grad()[self.lo - first:self.hi - first]


@dataclass
class _Shard:
    """This rank's shard ``[lo, hi)`` of one bucket. Elements ``[split, hi)`` have their
    fp32 master on the device (``master`` ``[hi - split]``, the parameters' own shard for
    fp32 training); ``[lo, split)`` (``--optimizer-cpu-offload``) in host memory
    (``host_master`` and the gradients' host copy ``host_grad``, both ``[split - lo]``)."""

    bucket: Bucket
    lo: int
    hi: int
    split: int
    master: torch.Tensor
    host_master: torch.Tensor | None = None
    host_grad: torch.Tensor | None = None
    pieces: list = field(default_factory=list)

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.shard_grad()


class DistributedOptimizer(LossScaledOptimizer):
    """Same interface as :class:`megalite.optim.optimizer.MixedPrecisionOptimizer`, state
    sharded over data parallelism (see module docstring)."""

    def __init__(self, model, ocfg: OptimConfig, ps: ParallelState, scaler,
                 grads: DataParallelGrads, fp16: bool = False):
        if not grads.sharded:
            raise ValueError("the distributed optimizer needs DataParallelGrads built with "
                             "use_distributed_optimizer=True")
        self.ocfg, self.ps, self.scaler, self.fp16, self.grads = ocfg, ps, scaler, fp16, grads
        named = named_trainable_params(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        name_of = {id(p): n for n, p in named}
        self.half = any(p.dtype != torch.float32 for p in self.params)
        offload = getattr(ocfg, "optimizer_cpu_offload", False)
        self.pinned = host_memory_pinned(ps.device, "--optimizer-cpu-offload") if offload else False
        layout = []
        for buf in grads.buffers:
            for bucket in buf.buckets:
                lo, hi = bucket.shard_range()
                parts = [(name_of[id(p)], p, max(a, lo), min(b, hi), a)
                         for p, (a, b) in zip(bucket.params, bucket.ranges)
                         if max(a, lo) < min(b, hi)]
                layout.append((bucket, lo, hi, parts))
        # offload whole pieces, first to last, until the fraction of the elements is reached
        total = sum(e - s for *_, parts in layout for _, _, s, e, _ in parts)
        budget = ocfg.optimizer_offload_fraction * total if offload else 0.0
        offloaded = 0
        self.shards: list[_Shard] = []
        for bucket, lo, hi, parts in layout:
            split = lo
            for _, _, s, e, _ in parts:
                if offloaded < budget:
                    offloaded, split = offloaded + e - s, e
            self.shards.append(self._shard(bucket, lo, hi, split, parts))
        self.offloaded_elements = offloaded
        self.pieces = [pc for sh in self.shards for pc in sh.pieces]
        self.keys = keys_by_name(ocfg, self.names, self.params)
        algorithm = algorithm_of(ocfg)
        algorithm.check(ocfg, named)
        self.inner = self._build_inner([pc for pc in self.pieces if not pc.host])
        self.host_inner = self._build_inner([pc for pc in self.pieces if pc.host])
        self.exchange = None
        if algorithm.orthogonal:   # whole matrices: each gathered on one owner (muon_layout)
            rule = rule_function(ocfg)
            muon = {id(p) for n, p in named if rule(n, p) == "muon"}
            self.exchange = OwnerExchange(grads.buffers, muon, name_of, ps, ocfg)
        self.num_steps = 0

    def _shard(self, bucket: Bucket, lo: int, hi: int, split: int, parts: list) -> _Shard:
        view = bucket.shard_param()[split - lo:]
        master = view.detach().float().clone() if self.half else view
        shard = _Shard(bucket, lo, hi, split, master)
        if split > lo:
            shard.host_master = torch.empty(split - lo, dtype=torch.float32,
                                            pin_memory=self.pinned)
            shard.host_master.copy_(bucket.shard_param()[:split - lo])
            shard.host_grad = torch.empty(split - lo, dtype=torch.float32,
                                          pin_memory=self.pinned)
        for name, p, s, e, a in parts:
            if s < split:
                shard.pieces.append(_Piece(name, p, bucket, s, e, s - a,
                                           shard.host_master[s - lo:e - lo],
                                           shard.host_grad[s - lo:e - lo]))
            else:
                shard.pieces.append(_Piece(name, p, bucket, s, e, s - a,
                                           master[s - split:e - split]))
        return shard

    def _build_inner(self, pieces: list):
        groups = param_groups([(pc.name, pc.param) for pc in pieces], self.ocfg.weight_decay,
                              updated=[pc.master for pc in pieces],
                              decoupled_lr=self.ocfg.decoupled_lr is not None,
                              rule_of=rule_function(self.ocfg))
        if not groups:
            return None
        inner = build_torch_optimizer(groups, self.ocfg)
        init_state(inner, self.ocfg)
        return inner

    def _inner_of(self, piece: _Piece):
        return self.host_inner if piece.host else self.inner

    @property
    def param_groups(self) -> list[dict]:
        return [g for inner in (self.inner, self.host_inner) if inner is not None
                for g in inner.param_groups]

    @torch.no_grad()
    def step(self, row_scales: dict | None = None) -> StepOutcome:
        """Unscale, check, clip, update this rank's shard (the offloaded part on the CPU),
        all-gather the parameters. ``row_scales`` ``{parameter: factor}`` (QK-clip): after
        the update each piece of such a parameter is multiplied by its elements of the
        factor (broadcast to the parameter's shape), before the shard is written into
        ``param_data`` and gathered, so masters and model agree with the one-process step;
        a skipped step applies none."""
        self.grads.wait_param_sync()
        grads = [sh.grad for sh in self.shards]
        if self._unscale_and_check(grads):
            if self.grads.fp8_buckets and self.grads.param_sharding is None:
                # --fp8-param-gather: the fp8 weights of the next step, from unchanged shards
                self.grads.start_param_sync()
            return StepOutcome(updated=False, found_inf=True, grad_norm=None)
        norm = sharded_grad_norm([(pc.param, pc.grad) for pc in self.pieces], self.ps)
        coeff = clip_coefficient(self.ocfg.clip_grad, norm)
        if coeff < 1.0:
            torch._foreach_mul_(grads, coeff)
        for sh in self.shards:
            if sh.host_grad is not None:   # device -> (pinned) host
                sh.host_grad.copy_(sh.grad[:sh.split - sh.lo], non_blocking=self.pinned)
        for pc in self.pieces:
            g = pc.host_grad if pc.host else pc.grad
            pc.master.grad = g if g.dtype == torch.float32 else g.float()
        if self.pinned and self.host_inner is not None:
            torch.cuda.current_stream(self.ps.device).synchronize()
        inners = [inner for inner in (self.inner, self.host_inner) if inner is not None]
        if self.exchange is None:
            for inner in inners:
                inner.step()
        else:   # momentum on the pieces, orthogonalise whole matrices, update the pieces
            piece_of = {id(pc.master): pc for pc in self.pieces}
            pairs = [(piece_of[id(t)], u) for inner in inners for t, u in inner.updates()]
            outs = self.exchange.run(pairs)
            for inner in inners:
                inner.apply({id(pc.master): o for (pc, _), o in zip(pairs, outs)})
        for pc in self.pieces:
            pc.master.grad = None
            if row_scales and pc.param in row_scales:
                factor = row_scales[pc.param].expand(pc.param.shape).reshape(-1)
                pc.master.mul_(factor[pc.start:pc.start + pc.hi - pc.lo].to(pc.master.device))
        for sh in self.shards:
            mine = sh.bucket.shard_param()
            if self.half:
                mine[sh.split - sh.lo:].copy_(sh.master)
            if sh.host_master is not None:   # host -> device, cast
                mine[:sh.split - sh.lo].copy_(sh.host_master, non_blocking=self.pinned)
        self.grads.start_param_sync()
        self.num_steps += 1
        return StepOutcome(updated=True, found_inf=False, grad_norm=norm)

    def owned_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, reduced gradient piece)`` of this rank's shard: the pieces of the
        data-parallel ranks partition the gradients (:mod:`megalite.optim.grad_stats`)."""
        return [(pc.param, pc.grad) for pc in self.pieces]

    def owned_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, fp32 master piece)`` of this rank's shard, likewise."""
        return [(pc.param, pc.master) for pc in self.pieces]

    def memory_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer holds on the device (shard masters and state), for
        accounting; the offloaded ones are :meth:`offloaded_tensors`."""
        held = [sh.master for sh in self.shards]
        if self.inner is not None:
            for state in self.inner.state.values():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    def offloaded_tensors(self) -> list[torch.Tensor]:
        """The tensors ``--optimizer-cpu-offload`` keeps in host memory: masters, gradient
        copies and state of the offloaded pieces."""
        held = [t for sh in self.shards for t in (sh.host_master, sh.host_grad)
                if t is not None]
        if self.host_inner is not None:
            for state in self.host_inner.state.values():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    # -- checkpointing ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the shard masters from the model (after loading model weights; under
        optim_grads_params the loaded, gathered parameters are first copied into the
        shards)."""
        self.grads.wait_param_sync()
        if self.grads.param_sharding is not None:
            self.grads.param_sharding.write_back()
        for sh in self.shards:
            mine = sh.bucket.shard_param()
            if self.half:
                sh.master.copy_(mine[sh.split - sh.lo:])
            if sh.host_master is not None:
                sh.host_master.copy_(mine[:sh.split - sh.lo])

    @torch.no_grad()
    def state_dict_per_param(self) -> dict:
        """Full per-parameter tensors (:mod:`megalite.optim.optimizer_state`), gathered
        from every rank's shard: a collective over each buffer's group. Also completes
        any parameter all-gather in flight, so a checkpoint written next sees current
        parameters."""
        self.grads.finish_param_sync()
        half = ("master",) if self.half else ()
        fields = tuple(dict.fromkeys(k for keys in self.keys.values() for k in keys)) + half
        out: dict[str, dict] = {n: {} for n in self.names}
        name_of = {id(p): n for n, p in zip(self.names, self.params)}
        for sh in self.shards:
            bucket, group = sh.bucket, sh.bucket.group
            for key in fields:
                holders = {id(p) for p in bucket.params
                           if key == "master" or key in self.keys[name_of[id(p)]]}
                if not holders:
                    continue
                local = torch.zeros(sh.hi - sh.lo, dtype=torch.float32, device=self.ps.device)
                for pc in sh.pieces:
                    if key != "master" and key not in self.keys[pc.name]:
                        continue
                    value = pc.master if key == "master" else state_tensor(
                        self._inner_of(pc), pc.master, key)
                    local[pc.lo - sh.lo:pc.hi - sh.lo] = value
                full = local
                if group.size > 1:
                    full = torch.empty(bucket.numel, dtype=torch.float32, device=local.device)
                    collectives.all_gather_into_tensor(full, local, group)
                for p, (a, b) in zip(bucket.params, bucket.ranges):
                    if id(p) in holders:
                        out[name_of[id(p)]][key] = full[a:b].view(p.shape).clone()
        return {"step": self.num_steps, "params": out}

    @torch.no_grad()
    def load_state_dict_per_param(self, state: dict) -> None:
        """Keep this rank's slices of full per-parameter tensors (no collective)."""
        keys = self._check_per_param(state)
        self.grads.wait_param_sync()
        sharding = self.grads.param_sharding
        step, saved = int(state["step"]), state["params"]
        for pc in self.pieces:
            entry = saved[pc.name]
            sl = slice(pc.start, pc.start + pc.hi - pc.lo)
            if step > 0 and keys[pc.name]:
                set_state(self._inner_of(pc), pc.master, keys[pc.name],
                          {k: entry[k].reshape(-1)[sl] for k in keys[pc.name]}, step)
        if self.half and not any("master" in saved[n] for n in self.names):
            self.reload_model_params()
        elif self.half:
            for p, name in zip(self.params, self.names):
                if "master" in saved[name] and sharding is None:
                    p.copy_(saved[name]["master"])     # every rank holds the full master
            for pc in self.pieces:
                if "master" in saved[pc.name]:
                    pc.master.copy_(saved[pc.name]["master"].reshape(-1)[
                        pc.start:pc.start + pc.hi - pc.lo])
                    if sharding is not None:   # this rank's shard of the parameter
                        first = pc.bucket.shard_range()[0]
                        pc.bucket.shard_param()[pc.lo - first:pc.hi - first].copy_(
                            pc.master)
            if sharding is not None:
                sharding.invalidate()     # gathered copies are stale now
        self.num_steps = step

    def state_dict(self) -> dict:
        """The per-parameter form, for the per-rank checkpoint (collective, see module
        docstring)."""
        return {"per_param": self.state_dict_per_param(), "names": list(self.names),
                "step": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`, or a :class:`MixedPrecisionOptimizer` state dict."""
        if "per_param" not in state:
            state = {"per_param": per_param_from_torch(state, state["names"], self.keys)}
        self.load_state_dict_per_param(state["per_param"])
