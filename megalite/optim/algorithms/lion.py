"""``--optimizer lion``: Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms",
arXiv:2302.06675) for the linear layers' weights, AdamW for the rest, as Megatron-LM's
``--optimizer lion`` splits them (its emerging-optimizer path: 2-D weights other than the
word embedding and the output layer take the emerging optimizer, the rest AdamW with
--adam-beta1/2, --adam-eps).

Which parameters are Lion's (:func:`is_linear_weight`): every 2-D weight (an ``[E, a, b]``
expert stack: its experts' weights) other than the word embedding and the output layer;
the router's weight and learned position embeddings included, as in Megatron-LM. Norms,
biases, the word embedding and the output layer follow AdamW. With ``--optimizer muon
--muon-scalar-optimizer lion`` Lion instead takes the parameters Muon does not
orthogonalise.

One Lion step of a tensor ``W`` with gradient ``G`` (``b1``, ``b2``: ``--lion-beta1``,
``--lion-beta2``)::

    W <- W (1 - lr wd)                                   (decoupled weight decay)
    W <- W - lr sign(b1 M + (1 - b1) G)
    M <- b2 M + (1 - b2) G                               (state "exp_avg", fp32)

One state tensor per Lion parameter (half of Adam's) and no step count; element-wise, so exact
on any piece of a tensor (the distributed optimizer's shards, ZeRO-3's).

Megatron-Core 0.19.2's ``--optimizer lion`` builds its Lion with ``--adam-beta1/2`` as the
betas (``--lion-beta1/2`` reach only its ``--muon-scalar-optimizer lion``); megalite's
Lion always takes ``--lion-beta1/2``, the flags' documented meaning. A Megatron script
that relied on the Adam betas sets ``--lion-beta1/2`` to them; a converted Megatron
checkpoint carries the betas its Lion ran with.

Its update has the same size whatever the gradient's: an element whose ``b1 M + (1 - b1)
G`` is a rounding away from 0 may take the other sign in another layout, where the
gradient's sums run in another order (the layout fuzzer allows a ten-thousandth of a
tensor's elements that), and a parameter whose gradient is 0 but for rounding (the
attention's key bias, under ``--muon-scalar-optimizer lion``) drifts by ``lr`` a step.
"""

from __future__ import annotations

import torch

from megalite.optim.algorithms.adam import ADAM_KEYS, build_adamw, init_adam_groups
from megalite.optim.algorithms.base import (
    Algorithm,
    is_embedding_or_output,
    is_weight_matrix,
    shared_optimizer,
    state_tensors,
)

LION_KEYS = ("exp_avg",)


def is_linear_weight(name: str, param: torch.Tensor) -> bool:
    """Whether ``--optimizer lion`` steps ``param`` with Lion: a 2-D weight (an ``[E, a,
    b]`` expert stack) other than the word embedding and the output layer (Megatron-LM's
    rule: its emerging optimizers take every 2-D parameter not marked
    ``is_embedding_or_output_parameter``, learned position embeddings included)."""
    return is_weight_matrix(param) and not is_embedding_or_output(name)


class LionOptimizer(torch.optim.Optimizer):
    """Lion over the groups of ``groups`` marked ``rule: "lion"`` (or unmarked), each with
    its own ``lr`` and ``weight_decay``, ``betas`` from ``--lion-beta1/2``; a torch AdamW
    sharing these group dicts and this state (``ocfg``'s settings) over those marked
    ``rule: "adam"``. The state ``exp_avg`` is created at a tensor's first step (zeros),
    or up front by :meth:`Lion.init_state`; tensors without a gradient are not touched,
    weight decay included (as torch's optimizers do)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float],
                 weight_decay: float, ocfg=None):
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:   # (AdamW's groups take AdamW's betas)
            if group.get("rule", "lion") == "lion":
                group.setdefault("betas", tuple(betas))
        self.ocfg = ocfg
        self._link_adam()

    def _link_adam(self) -> None:
        self.adam = shared_optimizer([g for g in self.param_groups if g.get("rule") == "adam"],
                                     self.state, lambda groups: build_adamw(groups, self.ocfg))

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link_adam()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LionOptimizer.step takes no closure")
        for group in self.param_groups:
            if group.get("rule", "lion") != "lion":
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moments = state_tensors(self, params, "exp_avg")
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            signs = torch._foreach_lerp(moments, grads, 1 - beta1)
            torch._foreach_sign_(signs)
            torch._foreach_add_(params, signs, alpha=-lr)
            torch._foreach_lerp_(moments, grads, 1 - beta2)
        if self.adam is not None:
            self.adam.step()


def build_lion(groups: list[dict], ocfg) -> LionOptimizer:
    return LionOptimizer(groups, lr=ocfg.lr, betas=(ocfg.lion_beta1, ocfg.lion_beta2),
                         weight_decay=ocfg.weight_decay, ocfg=ocfg)


class Lion(Algorithm):
    name = "lion"

    def rule(self, ocfg, name, param):
        return "lion" if is_linear_weight(name, param) else "adam"

    def rules(self, ocfg):
        return ("lion", "adam")

    def state_keys(self, ocfg, rule=None):
        return ADAM_KEYS if rule == "adam" else LION_KEYS

    def build(self, groups, ocfg):
        return build_lion(groups, ocfg)

    def init_state(self, optimizer, ocfg):
        init_adam_groups(optimizer, [g for g in optimizer.param_groups
                                     if g.get("rule") == "adam"])
        for group in optimizer.param_groups:
            if group.get("rule", "lion") == "lion":
                for p in group["params"]:
                    if not optimizer.state.get(p):
                        optimizer.state[p] = {"exp_avg": torch.zeros_like(p)}

    def state_floats(self, ocfg, rule=None):
        """Lion's one state tensor (``rule`` None or ``lion``), AdamW's two (``adam``)."""
        return len(self.state_keys(ocfg, rule))


ALGORITHM = Lion()
