"""``--optimizer muon``: momentum orthogonalised by Newton-Schulz for the weight matrices,
``--muon-scalar-optimizer`` (AdamW, or Lion) for everything else.

Which parameters are matrices (:func:`is_matrix`): the 2-D weights of the linear layers
and the ``[E, ...]`` stacks of expert weights (orthogonalised one expert at a time); not
the word or position embeddings, the output layer, the router, norms or biases, which
follow the scalar optimizer (AdamW with --adam-beta1/2, --adam-eps; or Lion with
--lion-beta1/2).

One step of a matrix ``W`` with gradient ``G`` (Megatron-LM's Muon, through NVIDIA's
Emerging-Optimizers; ``beta`` = --muon-momentum)::

    M <- beta M + (1 - beta) G                     (state "momentum_buffer", fp32)
    U  = (1 - beta) G + beta M  with --muon-nesterov, else M
    O  = orthogonalize(U) * scale(out, in) * --muon-extra-scale-factor
    W <- W (1 - lr wd) - lr O                      (decoupled weight decay)

``orthogonalize`` is :func:`megalite.optim.newton_schulz.orthogonalize` of the *whole*
logical matrix (with --muon-split-qkv, each of Q, K and V of a fused QKV weight on its
own; SwiGLU's fused [gate; up] is one matrix, as in Megatron-LM): the element-wise parts
run on whatever this rank holds, and :meth:`MuonOptimizer.step` hands the ``U`` of its
matrices to ``self.orthogonalize``, which the wrapper sets to the layout's collectives
(:mod:`megalite.optim.muon_layout`: tensor-parallel shards gathered or the iteration
distributed, data-parallel pieces sent to one owner per matrix).
"""

from __future__ import annotations

import torch

from megalite.optim.algorithms import adam, lion
from megalite.optim.algorithms.base import (Algorithm, is_weight_matrix, shared_optimizer,
                                            state_tensors)

MUON_KEYS = ("momentum_buffer",)
# --muon-scalar-optimizer: the algorithm of the parameters Muon does not orthogonalise
SCALAR: dict[str, Algorithm] = {"adam": adam.ALGORITHM, "lion": lion.ALGORITHM}
NOT_MATRICES = ("embedding", "output_layer", "router")


def is_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon orthogonalises ``param``: a 2-D weight (a ``[E, a, b]`` expert stack)
    that is not an embedding, the output layer or the router."""
    return is_weight_matrix(param) and not any(word in name for word in NOT_MATRICES)


class MuonOptimizer(torch.optim.Optimizer):
    """Muon over the groups marked ``rule: "muon"``, the scalar optimizer (a torch
    optimizer of :data:`SCALAR` sharing these group dicts and this state) over those
    marked with ``--muon-scalar-optimizer``'s rule (``adam`` or ``lion``).

    ``orthogonalize(pairs)``: ``pairs`` ``[(tensor, U)]`` for every Muon tensor of this
    optimizer, returns the orthogonalised and scaled ``O`` of each (same shapes); set by the
    wrapper. ``step()`` = :meth:`updates`, ``orthogonalize``, :meth:`apply`; the distributed
    optimizer calls the three itself, to orthogonalise the tensors of two of these (device
    and host) in one exchange."""

    def __init__(self, groups: list[dict], ocfg):
        defaults = {"lr": ocfg.lr, "weight_decay": ocfg.weight_decay,
                    "momentum": ocfg.muon_momentum, "nesterov": ocfg.muon_nesterov}
        super().__init__(groups, defaults)
        self.ocfg = ocfg
        self.orthogonalize = None
        self._link_scalar()

    def _link_scalar(self) -> None:
        rule = self.ocfg.muon_scalar_optimizer
        self.scalar = shared_optimizer([g for g in self.param_groups if g.get("rule") == rule],
                                       self.state,
                                       lambda groups: SCALAR[rule].build(groups, self.ocfg))

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link_scalar()

    def muon_tensors(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups if g.get("rule") == "muon" for p in g["params"]]

    @torch.no_grad()
    def updates(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Advance the momentum of every Muon tensor with a gradient; ``[(tensor, U)]``.
        Without --muon-nesterov ``U`` is the momentum buffer itself, which the
        orthogonalisation only reads. ``M <- lerp(M, G, 1 - beta)`` and Nesterov's
        ``U = lerp(G, M, beta)`` run as multi-tensor kernels per group (the per-tensor
        ``lerp``'s bits, one launch for all of a group's tensors)."""
        out = []
        for group in self.param_groups:
            if group.get("rule") != "muon":
                continue
            beta = group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = state_tensors(self, params, "momentum_buffer")
            grads = [p.grad for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - beta)
            us = torch._foreach_lerp(grads, bufs, beta) if group["nesterov"] else bufs
            out.extend(zip(params, us))
        return out

    @torch.no_grad()
    def apply(self, outputs: dict[int, torch.Tensor]) -> None:
        """``W <- W (1 - lr wd) - lr O`` for the Muon tensors (``outputs``: id(tensor) ->
        ``O``), then the scalar optimizer's step of the others."""
        for group in self.param_groups:
            if group.get("rule") != "muon":
                continue
            lr, wd = group["lr"], group["weight_decay"]
            params = [p for p in group["params"] if id(p) in outputs]
            if not params:
                continue
            if wd:      # (multi-tensor kernels: the per-tensor ops' bits, fewer launches)
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, [outputs[id(p)].to(p.dtype) for p in params],
                                alpha=-lr)
        if self.scalar is not None:
            self.scalar.step()

    @torch.no_grad()
    def step(self, closure=None):
        pairs = self.updates()
        if pairs and self.orthogonalize is None:
            raise RuntimeError("MuonOptimizer.orthogonalize is not set: the optimizer "
                               "wrapper provides the layout's orthogonalisation")
        outs = self.orthogonalize(pairs) if pairs else []
        self.apply({id(p): o for (p, _), o in zip(pairs, outs)})


class Muon(Algorithm):
    name = "muon"
    orthogonal = True

    def rule(self, ocfg, name, param):
        return "muon" if is_matrix(name, param) else ocfg.muon_scalar_optimizer

    def rules(self, ocfg):
        return ("muon", ocfg.muon_scalar_optimizer)

    def state_keys(self, ocfg, rule=None):
        return MUON_KEYS if rule == "muon" else SCALAR[rule].state_keys(ocfg, rule)

    def build(self, groups, ocfg):
        return MuonOptimizer(groups, ocfg)

    def init_state(self, optimizer, ocfg):
        if optimizer.scalar is not None:
            SCALAR[ocfg.muon_scalar_optimizer].init_state(optimizer.scalar, ocfg)
        for p in optimizer.muon_tensors():
            if not optimizer.state.get(p):
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}

    def state_floats(self, ocfg, rule=None):
        """The matrices' momentum (``rule`` None or ``muon``), or the scalar optimizer's
        state (``rule`` ``adam`` or ``lion``)."""
        return len(self.state_keys(ocfg, rule or "muon"))

    def check(self, ocfg, named_params):
        from megalite.optim.muon_layout import check_matrix

        for name, p in named_params:
            if is_matrix(name, p):
                check_matrix(name, p, ocfg)


ALGORITHM = Muon()
