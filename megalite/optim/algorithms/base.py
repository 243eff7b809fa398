"""The interface every optimizer algorithm implements (one file per ``--optimizer``).

An :class:`Algorithm` says, for the optimizer wrappers of ``optim/``
(:class:`~megalite.optim.optimizer.MixedPrecisionOptimizer` and the distributed optimizer),
how to update the fp32 master tensors they hold:

- ``rule(ocfg, name, param)``: which update rule a parameter follows (Muon keeps a second
  rule, ``adam``, for the parameters it does not orthogonalise); parameters of one rule go
  to param groups of their own, marked ``group["rule"]``;
- ``state_keys(ocfg, rule)``: the names of the per-element state tensors of that rule
  (``exp_avg``, ``momentum_buffer``, ...), which are the checkpoint's keys
  (:mod:`megalite.optim.optimizer_state`);
- ``build(groups, ocfg)``: the torch optimizer over those groups; ``init_state``: its
  state created up front (measurable memory from the start);
- ``state_floats(ocfg, rule)``: fp32 state tensors per parameter of that rule, for the
  memory estimates;
- ``orthogonal``: True when the update of a matrix needs the whole matrix (Muon). The
  optimizer built then offers ``updates()`` / ``apply(outputs)`` around an orthogonalisation
  the wrapper performs with the layout's collectives
  (:mod:`megalite.optim.muon_layout`); an element-wise algorithm (``orthogonal`` False) is
  exact on any 1-D piece of a tensor, which the distributed optimizer relies on.
"""

from __future__ import annotations

import torch

from megalite.parallel.params import param_meta


class Algorithm:
    """An optimizer algorithm; subclasses set ``name`` and implement the methods."""

    name: str = ""
    orthogonal: bool = False

    def rule(self, ocfg, name: str, param: torch.Tensor) -> str:
        """The update rule of parameter ``name`` (default: the algorithm's own)."""
        return self.name

    def rules(self, ocfg) -> tuple[str, ...]:
        """Every rule this algorithm uses."""
        return (self.name,)

    def state_keys(self, ocfg, rule: str | None = None) -> tuple[str, ...]:
        raise NotImplementedError

    def build(self, groups: list[dict], ocfg) -> torch.optim.Optimizer:
        raise NotImplementedError

    def init_state(self, optimizer: torch.optim.Optimizer, ocfg) -> None:
        """Create the state up front (default: lazily, by the first step)."""

    def state_floats(self, ocfg, rule: str | None = None) -> int:
        """fp32 state tensors per parameter of ``rule`` (the memory estimates' count)."""
        return len(self.state_keys(ocfg, rule))

    def check(self, ocfg, named_params: list) -> None:
        """Raise ValueError naming a parameter this algorithm cannot update."""


def is_weight_matrix(param: torch.Tensor) -> bool:
    """A 2-D weight, or an ``[E, a, b]`` stack of expert weights (one matrix per expert)."""
    return param.dim() == (3 if param_meta(param).expert else 2)


EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    """Megatron-LM's ``is_embedding_or_output_parameter``: the input word embedding and the
    output layer's weight (also a later stage's or the prediction depths' copy of a tied
    embedding), not position embeddings or anything else. ``--decoupled-lr`` applies to
    them; ``--optimizer lion`` steps them with AdamW."""
    return name.endswith(EMBEDDING_OR_OUTPUT)


def shared_optimizer(groups: list[dict], state, build) -> torch.optim.Optimizer | None:
    """``build(groups)``, a torch optimizer over some of another optimizer's groups that
    keeps those very group dicts (whose ``lr`` the schedule sets there) and that
    optimizer's ``state``; None without groups. Muon's scalar optimizer and Lion's AdamW
    part are such."""
    if not groups:
        return None
    optimizer = build(groups)
    optimizer.param_groups, optimizer.state = groups, state
    return optimizer


def foreach_or_fused(groups: list[dict]) -> dict:
    """The fused CUDA kernels when every tensor is on a GPU, else the multi-tensor
    (``foreach``) implementation instead of a loop over tensors. Both compute the
    single-tensor update's formula."""
    devices = {p.device.type for group in groups for p in group["params"]}
    return {"fused": True} if devices == {"cuda"} else {"foreach": True}


def state_tensors(optimizer: torch.optim.Optimizer, params: list, key: str) -> list:
    """``optimizer.state[p][key]`` of each of ``params``, made as zeros like ``p`` where
    the step is its first (the multi-tensor updates' state lists)."""
    for p in params:
        if key not in optimizer.state[p]:
            optimizer.state[p][key] = torch.zeros_like(p)
    return [optimizer.state[p][key] for p in params]
