"""The optimizer: the ``--optimizer`` algorithm (:mod:`megalite.optim.algorithms`: AdamW,
SGD, Muon) on fp32 master weights, loss-scale aware, with global-norm clipping and skipping
of steps whose gradients are not finite.

Precision handling:

- fp32: the model's parameters are the master weights; ``param.grad`` is pointed at the
  fp32 ``param.main_grad`` for the update.
- bf16 / fp16: the model holds half-precision parameters; the optimizer keeps an fp32 copy
  (master) of each, updates the masters from ``main_grad`` and copies them back (cast) into
  the model after every successful step.

A step (:meth:`MixedPrecisionOptimizer.step`) after the data-parallel reduction:
unscale ``main_grad`` by ``1 / loss_scale`` -> any inf/nan on any rank? (skip, and the loss
scaler backs off) -> global grad norm (SUM over the world of what each rank owns, see
:mod:`megalite.optim.clip_grads`) -> clip -> update -> copy to model.

:class:`megalite.optim.distributed_optimizer.DistributedOptimizer` does the same on a
data-parallel shard; both offer ``state_dict()`` / ``load_state_dict()`` and the
per-parameter form ``state_dict_per_param()`` / ``load_state_dict_per_param()``
(:mod:`megalite.optim.optimizer_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import OptimConfig
from megalite.optim.clip_grads import (
    clip_grads_,
    first_replica,
    found_non_finite,
    global_grad_norm,
)
from megalite.optim.algorithms import algorithm_of
from megalite.optim.algorithms.base import is_embedding_or_output
from megalite.optim.optimizer_state import (
    check_per_param,
    init_state,
    keys_by_name,
    named_trainable_params,
    per_param_from_torch,
    set_state,
    state_tensor,
)
from megalite.optim.muon_layout import matrices, orthogonalize_local
from megalite.parallel.state import ParallelState


@dataclass
class StepOutcome:
    """What happened in one optimizer step (identical on every rank)."""

    updated: bool                # False when skipped because of inf/nan gradients
    found_inf: bool
    grad_norm: float | None   # before clipping; None when skipped


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights and biases (any 1-D parameter, or a name ending in ``bias``) get no
    weight decay."""
    return param.dim() > 1 and not name.endswith("bias")


def param_groups(named_params: list, weight_decay: float,
                 updated: list[torch.Tensor] | None = None,
                 decoupled_lr: bool = False, rule_of=None) -> list[dict]:
    """Split ``[(name, parameter), ...]`` into a decayed and a non-decayed group (empty
    groups are dropped; :func:`uses_weight_decay` decides). The groups hold ``updated[i]``
    for ``named_params[i]``: the tensor the optimizer steps (default: the parameter
    itself; the distributed optimizer's fp32 shard piece). Each group carries ``names``
    for error messages.

    ``decoupled_lr`` (``--decoupled-lr`` set): the embedding and output parameters
    (:func:`is_embedding_or_output`) go to groups of their own, after the others, marked
    ``decoupled_lr: True`` for :meth:`megalite.optim.lr_schedule.LRScheduler.apply`.

    ``rule_of(name, param)`` (an algorithm with several update rules, Muon): the groups are
    split by rule too, in order of first appearance, each marked ``rule``."""
    updated = [p for _, p in named_params] if updated is None else updated
    members = list(zip(named_params, updated))
    rule = (lambda n, p: None) if rule_of is None else rule_of
    rules = list(dict.fromkeys(rule(n, p) for n, p in named_params))
    groups = []
    for which in rules:
        for decoupled in ((False, True) if decoupled_lr else (False,)):
            for decay, wd in ((True, weight_decay), (False, 0.0)):
                chosen = [(n, t) for (n, p), t in members if uses_weight_decay(n, p) == decay
                          and (not decoupled_lr or is_embedding_or_output(n) == decoupled)
                          and rule(n, p) == which]
                if chosen:
                    group = {"params": [t for _, t in chosen], "weight_decay": wd,
                             "names": [n for n, _ in chosen]}
                    if decoupled:
                        group["decoupled_lr"] = True
                    if which is not None:
                        group["rule"] = which
                    groups.append(group)
    return groups


def rule_function(ocfg: OptimConfig):
    """``rule_of`` for :func:`param_groups`: None for a one-rule algorithm."""
    alg = algorithm_of(ocfg)
    if len(set(alg.rules(ocfg))) == 1:
        return None
    return lambda name, param: alg.rule(ocfg, name, param)


class LossScaledOptimizer:
    """What every megalite optimizer shares: the loss scale (``self.scaler``, from
    :mod:`megalite.optim.loss_scaler`), the unscale-and-check prologue of a step, and the
    validation of a per-parameter state before loading it."""

    scaler: object
    ps: ParallelState
    ocfg: OptimConfig
    names: list[str]
    params: list[torch.Tensor]
    half: bool

    def _check_per_param(self, state: dict) -> dict[str, tuple[str, ...]]:
        """Check ``state`` (per-parameter form) against this optimizer's parameters;
        returns the optimizer-state keys each must hold (e.g. exp_avg, exp_avg_sq)."""
        keys = keys_by_name(self.ocfg, self.names, self.params)
        check_per_param(state, dict(zip(self.names, (p.shape for p in self.params))), keys,
                        self.half)
        return keys

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call backward on this."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the loss scale in place; True when any rank holds an inf/nan
        (collective over the world); the scaler backs off or grows accordingly."""
        found_inf = found_non_finite(grads, None, self.ps.device,
                                     1.0 / float(self.scaler.scale))
        self.scaler.update(found_inf)
        return found_inf


class MixedPrecisionOptimizer(LossScaledOptimizer):
    """Wraps a torch optimizer over fp32 masters of ``model``'s trainable parameters.

    ``model`` (a Module or a list of pipeline chunks) must already have
    ``param.main_grad`` attached (see
    :class:`megalite.optim.data_parallel.DataParallelGrads`). ``scaler`` is a loss scaler
    from :mod:`megalite.optim.loss_scaler` (scale 1 unless fp16).
    """

    def __init__(self, model, ocfg: OptimConfig, ps: ParallelState, scaler,
                 fp16: bool = False):
        self.ocfg = ocfg
        self.ps = ps
        self.scaler = scaler
        self.fp16 = fp16
        named = named_trainable_params(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.half = any(p.dtype != torch.float32 for p in self.params)
        if self.half:
            self.masters = [p.detach().clone().float() for p in self.params]
        else:
            self.masters = self.params
        named = list(zip(self.names, self.params))
        algorithm_of(ocfg).check(ocfg, named)
        groups = param_groups(named, ocfg.weight_decay, updated=self.masters,
                              decoupled_lr=ocfg.decoupled_lr is not None,
                              rule_of=rule_function(ocfg))
        self.inner = build_torch_optimizer(groups, ocfg)
        init_state(self.inner, ocfg)
        if algorithm_of(ocfg).orthogonal:
            self._matrices = dict(zip(map(id, self.masters),
                                      matrices(named, ps, ocfg)))
            self.inner.orthogonalize = self._orthogonalize
        self.num_steps = 0

    def _orthogonalize(self, pairs: list) -> list[torch.Tensor]:
        """Every replica orthogonalises its whole (tp-local) masters' updates; collectives
        over ``ps.tp`` / ``ps.etp`` (:mod:`megalite.optim.muon_layout`)."""
        return orthogonalize_local([(self._matrices[id(m)], u) for m, u in pairs],
                                   self.ocfg)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def step(self, row_scales: dict | None = None) -> StepOutcome:
        """Unscale, check, clip and apply the update (collectives over the world for the
        inf check and the norm). ``row_scales`` ``{parameter: factor}`` (QK-clip,
        :mod:`megalite.optim.qk_clip`): after the update each such master is multiplied by
        its factor (broadcast to its shape), before the copy into the model; a skipped step
        applies none."""
        grads = [p.main_grad for p in self.params]
        if self._unscale_and_check(grads):
            return StepOutcome(updated=False, found_inf=True, grad_norm=None)
        norm = global_grad_norm(self.params, self.ps)
        if self.ocfg.clip_grad > 0:
            clip_grads_(self.params, self.ocfg.clip_grad, norm)
        for master, p in zip(self.masters, self.params):
            master.grad = p.main_grad if p.main_grad.dtype == master.dtype \
                else p.main_grad.to(master.dtype)
        self.inner.step()
        for master in self.masters:
            master.grad = None
        for master, p in zip(self.masters, self.params):
            if row_scales and p in row_scales:
                master.mul_(row_scales[p])
        if self.half:
            torch._foreach_copy_(self.params, self.masters)
        self.num_steps += 1
        return StepOutcome(updated=True, found_inf=False, grad_norm=norm)

    def owned_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, main_grad)`` of the parameters whose reduced gradient this rank counts
        for the data-parallel group: all of them on data-parallel rank 0 (``ps.dp_cp``,
        ``ps.edp`` for experts), none elsewhere (:mod:`megalite.optim.grad_stats`)."""
        return [(p, p.main_grad) for p in self.params if first_replica(p, self.ps)]

    def owned_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, fp32 master)`` likewise (:mod:`megalite.optim.grad_stats`)."""
        return [(p, m) for p, m in zip(self.params, self.masters)
                if first_replica(p, self.ps)]

    def memory_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer holds (masters and state), for memory accounting."""
        held = list(self.masters)
        for state in self.inner.state.values():
            held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    # -- checkpointing ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading model weights)."""
        if self.half:
            torch._foreach_copy_(self.masters, [p.float() for p in self.params])

    def state_dict(self) -> dict:
        """Optimizer moments and step counts, plus the fp32 masters under bf16/fp16."""
        state = {"optimizer": self.inner.state_dict(), "names": list(self.names),
                 "step": self.num_steps}
        if self.half:
            state["fp32_masters"] = [m.detach().clone() for m in self.masters]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` (same parameters), or the per-parameter form that the
        distributed optimizer's ``state_dict`` holds."""
        if "per_param" in state:
            self.load_state_dict_per_param(state["per_param"])
            return
        if state.get("names") is not None and list(state["names"]) != self.names:
            raise ValueError("the optimizer state in the checkpoint was saved for other "
                             "parameters (first difference: "
                             f"{_first_difference(state['names'], self.names)})")
        inner = state["optimizer"]
        for saved, live in zip(inner["param_groups"], self.inner.param_groups):
            saved["names"] = live["names"]  # keep our bookkeeping keys
            if "rule" in live:
                saved["rule"] = live["rule"]
        self.inner.load_state_dict(inner)
        self.num_steps = int(state.get("step", per_param_from_torch(
            state, self.names, keys_by_name(self.ocfg, self.names, self.params))["step"]))
        masters = state.get("fp32_masters")
        if self.half:
            if masters is None:
                self.reload_model_params()
            else:
                torch._foreach_copy_(self.masters, masters)
                torch._foreach_copy_(self.params, self.masters)

    def state_dict_per_param(self) -> dict:
        """The per-parameter form (:mod:`megalite.optim.optimizer_state`); no collective."""
        keys = keys_by_name(self.ocfg, self.names, self.params)
        params = {}
        for name, master in zip(self.names, self.masters):
            entry = {k: state_tensor(self.inner, master, k).clone() for k in keys[name]}
            if self.half:
                entry["master"] = master.detach().clone()
            params[name] = entry
        return {"step": self.num_steps, "params": params}

    @torch.no_grad()
    def load_state_dict_per_param(self, state: dict) -> None:
        """Install the per-parameter form (tensors of the parameters' local shapes)."""
        keys = self._check_per_param(state)
        step = int(state["step"])
        for name, p, master in zip(self.names, self.params, self.masters):
            entry = state["params"][name]
            if step > 0 and keys[name]:
                set_state(self.inner, master, keys[name], entry, step)
            if self.half and "master" in entry:
                master.copy_(entry["master"])
                p.copy_(master)
        self.num_steps = step


def build_torch_optimizer(groups: list[dict], ocfg: OptimConfig) -> torch.optim.Optimizer:
    """The ``--optimizer`` algorithm's torch optimizer over ``groups`` (each with its own
    ``weight_decay``, and its ``rule`` under Muon), updating the (fp32 master) tensors."""
    return algorithm_of(ocfg).build(groups, ocfg)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter {i}: saved {x!r}, model has {y!r}"
    return f"saved {len(a)} parameters, model has {len(b)}"
