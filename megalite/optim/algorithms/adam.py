"""``--optimizer adam``: AdamW (decoupled weight decay), ``--adam-beta1/2``, ``--adam-eps``.

State per parameter: ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape) and a
step count; element-wise, so exact on any piece of a tensor.
"""

from __future__ import annotations

import torch

from megalite.optim.algorithms.base import Algorithm, foreach_or_fused

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def step_tensor(p: torch.Tensor, step: int) -> torch.Tensor:
    """Adam's 0-d step count for ``p``, where torch keeps it: on the GPU beside a CUDA
    parameter (the fused kernel reads it there, :func:`foreach_or_fused`), on the CPU
    otherwise."""
    device = p.device if p.device.type == "cuda" else None
    return torch.tensor(float(step), dtype=scalar_dtype(), device=device)


def fresh_adam_state(p: torch.Tensor, step: int) -> dict:
    """Adam's state of ``p`` at ``step`` with zero moments: exactly what torch creates at
    the first step."""
    return {"step": step_tensor(p, step),
            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def build_adamw(groups: list[dict], ocfg) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2),
                             eps=ocfg.adam_eps, weight_decay=ocfg.weight_decay,
                             **foreach_or_fused(groups))


def init_adam_groups(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    for group in groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = fresh_adam_state(p, 0)


class Adam(Algorithm):
    name = "adam"

    def state_keys(self, ocfg, rule=None):
        return ADAM_KEYS

    def build(self, groups, ocfg):
        return build_adamw(groups, ocfg)

    def init_state(self, optimizer, ocfg):
        init_adam_groups(optimizer, optimizer.param_groups)


ALGORITHM = Adam()
