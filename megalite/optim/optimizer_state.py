"""Helpers shared by both optimizers: parameter naming, fresh optimizer state, and the
per-parameter state format of the checkpoint contract::

    {"step": int,                          # successful updates so far
     "params": {name: {"exp_avg": T, "exp_avg_sq": T,      # Adam (AdamW)
                       "momentum_buffer": T,               # SGD with momentum; Muon's
                                                           # matrices (its other
                                                           # parameters: Adam's)
                       "master": T}}}                      # fp32 masters, bf16/fp16 only

Every ``T`` is fp32 with the parameter's own (tensor-parallel local) shape; ``name`` is
the parameter's name in its model chunk's ``named_parameters()`` (pipeline chunks use
global layer numbers, so names do not depend on the layout).
"""

from __future__ import annotations

import torch

from megalite.config import OptimConfig
from megalite.optim.algorithms import algorithm_of
from megalite.optim.algorithms.adam import ADAM_KEYS, fresh_adam_state, step_tensor
from megalite.pipeline.layout import model_chunks

__all__ = ["ADAM_KEYS", "SGD_KEYS", "fresh_adam_state", "state_keys", "keys_by_name",
           "named_trainable_params", "init_state", "set_state", "state_tensor",
           "check_per_param", "per_param_from_torch"]

SGD_KEYS = ("momentum_buffer",)


def state_keys(ocfg: OptimConfig, name: str | None = None,
               param: torch.Tensor | None = None) -> tuple[str, ...]:
    """Names of the per-element state tensors the optimizer keeps for parameter ``name``
    (its algorithm's rule for it: Muon keeps ``momentum_buffer`` for its matrices, Adam's
    moments for the rest); without a parameter, those of the algorithm's main rule."""
    alg = algorithm_of(ocfg)
    rule = alg.rule(ocfg, name, param) if param is not None else alg.rules(ocfg)[0]
    return alg.state_keys(ocfg, rule)


def keys_by_name(ocfg: OptimConfig, names: list[str], params: list[torch.Tensor]
                 ) -> dict[str, tuple[str, ...]]:
    """name -> :func:`state_keys` of each parameter."""
    return {n: state_keys(ocfg, n, p) for n, p in zip(names, params)}


def named_trainable_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``[(name, param)]`` over every chunk of ``model`` (see
    :func:`megalite.pipeline.layout.model_chunks`); raises if two chunks use one name."""
    named, seen_params, seen_names = [], set(), set()
    for chunk in model_chunks(model):
        items = (chunk.named_parameters() if isinstance(chunk, torch.nn.Module)
                 else ((f"param{i}", p) for i, p in enumerate(chunk)))
        for name, p in items:
            if not p.requires_grad or id(p) in seen_params:
                continue
            if name in seen_names:
                raise ValueError(f"two model chunks have a parameter named {name!r}; the "
                                 "optimizer state is keyed by name")
            seen_params.add(id(p))
            seen_names.add(name)
            named.append((name, p))
    return named


def init_state(optimizer: torch.optim.Optimizer, ocfg: OptimConfig) -> None:
    """Create the state up front where the algorithm does (Adam: step 0, zero moments,
    exactly what torch would create at the first step), so memory is allocated and
    measurable from the start."""
    algorithm_of(ocfg).init_state(optimizer, ocfg)


def set_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, keys: tuple[str, ...],
              values: dict, step: int) -> None:
    """Install ``values[key]`` (any shape with ``p.numel()`` elements) as ``p``'s state."""
    state = {}
    if keys == ADAM_KEYS:
        state["step"] = step_tensor(p, step)
    for key in keys:
        state[key] = values[key].detach().to(p.device, p.dtype).reshape(p.shape).clone()
    optimizer.state[p] = state


def state_tensor(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.Tensor:
    """``p``'s state ``key`` as fp32 (zeros when not created yet)."""
    value = optimizer.state.get(p, {}).get(key)
    if value is None:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return value.detach().float()


def check_per_param(state: dict, shapes: dict[str, tuple], keys: dict[str, tuple[str, ...]],
                    half: bool) -> None:
    """Raise ValueError naming the first parameter missing from ``state`` or of another
    shape; ``shapes``: name -> the parameter's local shape; ``keys``: name -> the state
    names it must hold (:func:`keys_by_name`)."""
    saved = state["params"]
    started = int(state["step"]) > 0   # before the first step: no moments
    for name, shape in shapes.items():
        if name not in saved:
            raise ValueError(f"the optimizer state has no entry for parameter {name!r}")
        needed = (keys[name] if started else ()) \
            + (("master",) if half and "master" in saved[name] else ())
        for key in needed:
            if key not in saved[name]:
                raise ValueError(f"the optimizer state of {name!r} has no {key!r}")
            if tuple(saved[name][key].shape) != tuple(shape):
                raise ValueError(f"the optimizer state {key!r} of {name!r} has shape "
                                 f"{tuple(saved[name][key].shape)}, the parameter "
                                 f"{tuple(shape)}")
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise ValueError(f"the optimizer state has entries for parameters this model does "
                         f"not have: {extra[:3]}")


def per_param_from_torch(state: dict, names: list[str], keys: dict[str, tuple[str, ...]]
                         ) -> dict:
    """Convert :meth:`MixedPrecisionOptimizer.state_dict` (torch's format, with ``names``
    per param group and ``fp32_masters`` in ``names`` order) to the per-parameter form;
    ``keys``: name -> its state names."""
    inner = state["optimizer"]
    by_name, step = {}, 0
    for group in inner["param_groups"]:
        for index, name in zip(group["params"], group["names"]):
            entry = inner["state"].get(index, {})
            by_name[name] = {k: entry[k] for k in keys[name] if entry.get(k) is not None}
            if "step" in entry:
                step = max(step, int(entry["step"]))
    masters = state.get("fp32_masters")
    if masters is not None:
        for name, master in zip(state["names"], masters):
            by_name.setdefault(name, {})["master"] = master
    return {"step": int(state.get("step", step)), "params": by_name}
