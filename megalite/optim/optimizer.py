"""The optimizer: AdamW (or SGD) on fp32 master weights, loss-scale aware, with global-norm
clipping and skipping of steps whose gradients are not finite.

Precision handling:

- fp32: the model's parameters are the master weights; ``param.grad`` is pointed at the
  fp32 ``param.main_grad`` for the update.
- bf16 / fp16: the model holds half-precision parameters; the optimizer keeps an fp32 copy
  (master) of each, updates the masters from ``main_grad`` and copies them back (cast) into
  the model after every successful step.

A step (:meth:`MixedPrecisionOptimizer.step`) after the data-parallel reduction:
unscale ``main_grad`` by ``1 / loss_scale`` -> any inf/nan on any rank? (skip, and the loss
scaler backs off) -> global grad norm over ``ps.mp`` -> clip -> update -> copy to model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import OptimConfig
from megalite.optim.clip_grads import clip_grads_, found_non_finite, global_grad_norm
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


def param_groups(named_params: list, weight_decay: float) -> list[dict]:
    """Split ``[(name, tensor), ...]`` into a decayed and a non-decayed group (empty groups
    are dropped). Each group carries ``names`` for error messages."""
    decay = [(n, p) for n, p in named_params if uses_weight_decay(n, p)]
    no_decay = [(n, p) for n, p in named_params if not uses_weight_decay(n, p)]
    groups = []
    for members, wd in ((decay, weight_decay), (no_decay, 0.0)):
        if members:
            groups.append({"params": [p for _, p in members], "weight_decay": wd,
                           "names": [n for n, _ in members]})
    return groups


class MixedPrecisionOptimizer:
    """Wraps a torch optimizer over fp32 masters of ``model``'s trainable parameters.

    ``model`` must already have ``param.main_grad`` attached (see
    :class:`megalite.optim.data_parallel.DataParallelGrads`). ``scaler`` is a loss scaler
    from :mod:`megalite.optim.loss_scaler` (scale 1 unless fp16).
    """

    def __init__(self, model: torch.nn.Module, ocfg: OptimConfig, ps: ParallelState,
                 scaler, fp16: bool = False):
        self.ocfg = ocfg
        self.ps = ps
        self.scaler = scaler
        self.fp16 = fp16
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.half = any(p.dtype != torch.float32 for p in self.params)
        if self.half:
            self.masters = [p.detach().clone().float() for p in self.params]
        else:
            self.masters = self.params
        groups = param_groups(list(zip(self.names, self.masters)), ocfg.weight_decay)
        self.inner = _build_torch_optimizer(groups, ocfg)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call backward on this."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    @torch.no_grad()
    def step(self) -> StepOutcome:
        """Unscale, check, clip and apply the update (collectives over the world for the
        inf check, over ``ps.mp`` for the norm)."""
        grads = [p.main_grad for p in self.params]
        scale = float(self.scaler.scale)
        if scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        found_inf = found_non_finite(grads, None, self.ps.device)
        self.scaler.update(found_inf)
        if found_inf:
            return StepOutcome(updated=False, found_inf=True, grad_norm=None)
        norm = global_grad_norm(self.params, self.ps)
        if self.ocfg.clip_grad > 0:
            clip_grads_(self.params, self.ocfg.clip_grad, norm)
        for master, p in zip(self.masters, self.params):
            master.grad = p.main_grad
        self.inner.step()
        for master in self.masters:
            master.grad = None
        if self.half:
            torch._foreach_copy_(self.params, self.masters)
        return StepOutcome(updated=True, found_inf=False, grad_norm=norm)

    # -- checkpointing ------------------------------------------------------------------
    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model (after loading model weights)."""
        if self.half:
            torch._foreach_copy_(self.masters, [p.float() for p in self.params])

    def state_dict(self) -> dict:
        """Optimizer moments and step counts, plus the fp32 masters under bf16/fp16."""
        state = {"optimizer": self.inner.state_dict(), "names": list(self.names)}
        if self.half:
            state["fp32_masters"] = [m.detach().clone() for m in self.masters]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("names") is not None and list(state["names"]) != self.names:
            raise ValueError("the optimizer state in the checkpoint was saved for other "
                             "parameters (first difference: "
                             f"{_first_difference(state['names'], self.names)})")
        inner = state["optimizer"]
        for saved, live in zip(inner["param_groups"], self.inner.param_groups):
            saved["names"] = live["names"]  # keep our bookkeeping key
        self.inner.load_state_dict(inner)
        masters = state.get("fp32_masters")
        if self.half:
            if masters is None:
                self.reload_model_params()
            else:
                torch._foreach_copy_(self.masters, masters)
                torch._foreach_copy_(self.params, self.masters)


def _build_torch_optimizer(groups: list[dict], ocfg: OptimConfig) -> torch.optim.Optimizer:
    if ocfg.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2),
                                 eps=ocfg.adam_eps, weight_decay=ocfg.weight_decay)
    if ocfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=ocfg.lr, momentum=ocfg.sgd_momentum,
                               weight_decay=ocfg.weight_decay)
    raise ValueError(f"unknown --optimizer {ocfg.optimizer!r}")


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter {i}: saved {x!r}, model has {y!r}"
    return f"saved {len(a)} parameters, model has {len(b)}"
