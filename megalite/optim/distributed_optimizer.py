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
from megalite.optim.optimizer import (
    LossScaledOptimizer,
    StepOutcome,
    build_torch_optimizer,
    param_groups,
)
from megalite.optim.optimizer_state import (
    init_state,
    named_trainable_params,
    per_param_from_torch,
    set_state,
    state_keys,
    state_tensor,
)
from megalite.parallel import collectives
from megalite.parallel.state import ParallelState


@dataclass
class _Piece:
    """Bucket elements ``[lo, hi)`` of ``param`` (starting at element ``start`` of the
    flattened parameter) that this rank owns; ``master`` is its fp32 ``[hi - lo]`` view."""

    name: str
    param: torch.nn.Parameter
    bucket: Bucket
    lo: int
    hi: int
    start: int
    master: torch.Tensor

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.grad[self.lo:self.hi]


@dataclass
class _Shard:
    """This rank's shard ``[lo, hi)`` of one bucket and its fp32 master ``[hi - lo]``."""

    bucket: Bucket
    lo: int
    hi: int
    master: torch.Tensor
    pieces: list = field(default_factory=list)

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.grad[self.lo:self.hi]


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
        self.shards: list[_Shard] = []
        for buf in grads.buffers:
            for bucket in buf.buckets:
                lo, hi = bucket.shard_range()
                view = bucket.param[lo:hi]
                master = view.detach().float().clone() if self.half else view
                shard = _Shard(bucket, lo, hi, master)
                for p, (a, b) in zip(bucket.params, bucket.ranges):
                    s, e = max(a, lo), min(b, hi)
                    if s < e:
                        shard.pieces.append(_Piece(name_of[id(p)], p, bucket, s, e, s - a,
                                                   master[s - lo:e - lo]))
                self.shards.append(shard)
        self.pieces = [pc for sh in self.shards for pc in sh.pieces]
        groups = param_groups([(pc.name, pc.param) for pc in self.pieces], ocfg.weight_decay,
                              updated=[pc.master for pc in self.pieces],
                              decoupled_lr=ocfg.decoupled_lr is not None)
        self.inner = build_torch_optimizer(groups, ocfg) if groups else None
        if self.inner is not None:
            init_state(self.inner, ocfg)
        self.num_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups if self.inner is not None else []

    @torch.no_grad()
    def step(self) -> StepOutcome:
        """Unscale, check, clip, update this rank's shard, all-gather the parameters."""
        self.grads.finish_param_sync()
        grads = [sh.grad for sh in self.shards]
        if self._unscale_and_check(grads):
            return StepOutcome(updated=False, found_inf=True, grad_norm=None)
        norm = sharded_grad_norm([(pc.param, pc.grad) for pc in self.pieces], self.ps)
        coeff = clip_coefficient(self.ocfg.clip_grad, norm)
        if coeff < 1.0:
            torch._foreach_mul_(grads, coeff)
        for pc in self.pieces:
            g = pc.grad
            pc.master.grad = g if g.dtype == torch.float32 else g.float()
        if self.inner is not None:
            self.inner.step()
        for pc in self.pieces:
            pc.master.grad = None
        if self.half:
            for sh in self.shards:
                sh.bucket.param[sh.lo:sh.hi].copy_(sh.master)
        self.grads.start_param_sync()
        self.num_steps += 1
        return StepOutcome(updated=True, found_inf=False, grad_norm=norm)

    def memory_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer holds (shard masters and state), for accounting."""
        held = [sh.master for sh in self.shards]
        if self.inner is not None:
            for state in self.inner.state.values():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    # -- checkpointing ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the shard masters from the model (after loading model weights)."""
        self.grads.finish_param_sync()
        if self.half:
            for sh in self.shards:
                sh.master.copy_(sh.bucket.param[sh.lo:sh.hi])

    @torch.no_grad()
    def state_dict_per_param(self) -> dict:
        """Full per-parameter tensors (:mod:`megalite.optim.optimizer_state`), gathered
        from every rank's shard: a collective over each buffer's group. Also completes
        any parameter all-gather in flight, so a checkpoint written next sees current
        parameters."""
        self.grads.finish_param_sync()
        fields = state_keys(self.ocfg) + (("master",) if self.half else ())
        out: dict[str, dict] = {n: {} for n in self.names}
        name_of = {id(p): n for n, p in zip(self.names, self.params)}
        for sh in self.shards:
            bucket, group = sh.bucket, sh.bucket.group
            for key in fields:
                local = torch.zeros(sh.hi - sh.lo, dtype=torch.float32, device=self.ps.device)
                for pc in sh.pieces:
                    value = pc.master if key == "master" else state_tensor(self.inner,
                                                                           pc.master, key)
                    local[pc.lo - sh.lo:pc.hi - sh.lo] = value
                full = local
                if group.size > 1:
                    full = torch.empty(bucket.numel, dtype=torch.float32, device=local.device)
                    collectives.all_gather_into_tensor(full, local, group)
                for p, (a, b) in zip(bucket.params, bucket.ranges):
                    out[name_of[id(p)]][key] = full[a:b].view(p.shape).clone()
        return {"step": self.num_steps, "params": out}

    @torch.no_grad()
    def load_state_dict_per_param(self, state: dict) -> None:
        """Keep this rank's slices of full per-parameter tensors (no collective)."""
        keys = self._check_per_param(state)
        self.grads.finish_param_sync()
        step, saved = int(state["step"]), state["params"]
        for pc in self.pieces:
            entry = saved[pc.name]
            sl = slice(pc.start, pc.start + pc.hi - pc.lo)
            if step > 0 and keys:
                set_state(self.inner, pc.master, keys,
                          {k: entry[k].reshape(-1)[sl] for k in keys}, step)
        if self.half and not any("master" in saved[n] for n in self.names):
            self.reload_model_params()
        elif self.half:
            for p, name in zip(self.params, self.names):
                if "master" in saved[name]:
                    p.copy_(saved[name]["master"])     # every rank holds the full master
            for pc in self.pieces:
                if "master" in saved[pc.name]:
                    pc.master.copy_(saved[pc.name]["master"].reshape(-1)[
                        pc.start:pc.start + pc.hi - pc.lo])
        self.num_steps = step

    def state_dict(self) -> dict:
        """The per-parameter form, for the per-rank checkpoint (collective, see module
        docstring)."""
        return {"per_param": self.state_dict_per_param(), "names": list(self.names),
                "step": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`, or a :class:`MixedPrecisionOptimizer` state dict."""
        if "per_param" not in state:
            state = {"per_param": per_param_from_torch(state, state["names"],
                                                       state_keys(self.ocfg))}
        self.load_state_dict_per_param(state["per_param"])
