"""Megatron-LM's optimizer state (``torch_dist``) -> megalite's per-parameter form, so that
an imported run resumes where Megatron stopped instead of restarting the optimizer.

Megatron-Core saves Adam's (and SGD's, Lion's) state per parameter, under the parameter's
sharded key with a prefix, in the formats read here::

    optimizer.state.exp_avg.<key>     optimizer.state.exp_avg_sq.<key>   (Adam)
    optimizer.state.momentum_buffer.<key>                                 (SGD)
    optimizer.state.exp_avg.<key>                  (Lion: the linear weights; a chained
                                                    Adam keeps the others' two moments)
    optimizer.state.fp32_param.<key>  or  optimizer.state.param.<key>     the fp32 main
                                      weights of a bf16 / fp16 model (plain / distributed)

* the plain optimizer (no ``--use-distributed-optimizer``): the step count is the common
  state's ``optimizer['state']['common_step']``;
* the distributed optimizer saved ``fully_reshardable``
  (``--dist-ckpt-optim-fully-reshardable``): the step count is in each parameter group;
* the distributed optimizer saved ``dp_reshardable`` (Megatron-LM's default): flat
  per-bucket buffers, turned into this per-parameter form by :mod:`.buckets`;
* legacy rank files (``--ckpt-format torch``): each rank's plain optimizer state by
  parameter index, placed by name and merged into this form by :mod:`.legacy_optimizer`
  and :mod:`.legacy` (the step count as ``common_step``).

Each state maps to megalite's names as the weights do (:func:`.mapping.to_megalite`: the
stacked layers split, q/k/v regrouped, experts transposed, vocabulary padding dropped).
The distributed optimizer's other formats (the deprecated ``dp_zero_gather_scatter``,
and ``fully_sharded_model_space``, older versions' default, which stores flattened
slices) are not read here, and the note says how to re-save the checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron import arguments, buckets, mapping

PREFIX = "optimizer.state."
# [chained_<i>.]optimizer.state.<state>.<model key> (the chained optimizers' prefix where
# Megatron adds it: a --use-distributed-optimizer run saved dp_reshardable)
STATE_KEY = re.compile(r"(?:chained_\d+\.)?optimizer\.state\.([^.]+)\.(.+)")
# Megatron's state name -> megalite's (optimizer_state's per-parameter form)
STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
          "momentum_buffer": "momentum_buffer", "fp32_param": "master", "param": "master"}
READABLE = (None, "fully_reshardable", "dp_reshardable")
ALGORITHMS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
              "lion": ("exp_avg",)}


@dataclass
class MegatronOptimizerState:
    """Megatron's optimizer state in megalite's names: ``params`` ``{parameter name: {state
    name: full fp32 tensor}}``, the optimizer's step count, where training stood
    (``iteration``, ``consumed_samples``, the scheduler's ``num_steps`` in samples) and an
    fp16 run's dynamic loss scale (``loss_scaler``: the fields of
    :class:`megalite.optim.loss_scaler.DynamicLossScaler` it sets; None: none saved)."""

    step: int
    params: dict[str, dict[str, torch.Tensor]]
    iteration: int
    consumed_samples: int
    scheduler_samples: int | None
    loss_scaler: dict | None = None


def _parts(key: str) -> tuple[str, str] | None:
    """``[chained_<i>.]optimizer.state.<state>.<model key>`` -> ``(state, model key)``
    (None: not a per-parameter state key)."""
    match = STATE_KEY.fullmatch(key)
    return (match.group(1), match.group(2)) if match else None


def optimizer_keys(keys) -> list[str]:
    """The optimizer state keys among a checkpoint's tensor keys: per parameter, or
    per bucket (:func:`.buckets.bucket_keys`)."""
    return ([k for k in keys if (_parts(k) or ("",))[0] in STATES]
            + buckets.bucket_keys(keys))


def _optimizers(common: dict) -> list[dict]:
    """Each torch optimizer's saved state (``{"param_groups", ["state"]}``) in the common
    state, whatever its nesting (a chained optimizer's ``{i: ...}``, a bf16 / fp16 or
    distributed optimizer's ``{"optimizer": ...}``)."""
    def walk(saved) -> list[dict]:
        if not isinstance(saved, dict):
            return []
        if "param_groups" in saved:
            return [saved]
        if "optimizer" in saved:
            return walk(saved["optimizer"])
        return [inner for key in sorted(k for k in saved if isinstance(k, int))
                for inner in walk(saved[key])]
    return walk(common.get("optimizer"))


def _grad_scalers(common: dict) -> list[dict]:
    """Each saved ``grad_scaler`` of the common state's optimizers: an fp16 run's mixed
    precision (or distributed) optimizer keeps its scaler's ``{"scale": [1] fp32,
    "growth_tracker", "hysteresis_tracker"}`` beside its torch optimizer's state (a
    constant scaler saves ``{}``); a chained optimizer has one per part."""
    def walk(saved) -> list[dict]:
        if not isinstance(saved, dict) or "param_groups" in saved:
            return []
        if "optimizer" in saved:
            found = saved.get("grad_scaler")
            return ([found] if found else []) + walk(saved["optimizer"])
        return [inner for key in sorted(k for k in saved if isinstance(k, int))
                for inner in walk(saved[key])]
    return walk(common.get("optimizer"))


def loss_scaler(common: dict) -> dict | None:
    """An fp16 Megatron run's dynamic loss scale as megalite's
    :class:`~megalite.optim.loss_scaler.DynamicLossScaler` fields (``scale``,
    ``clean_steps``: Megatron's growth tracker, ``hysteresis_left``: its hysteresis
    tracker; the two count the same things), from the first saved scaler (a chained
    optimizer's parts step on the same overflows); None where none is saved."""
    for saved in _grad_scalers(common):
        if "scale" in saved:
            return {"scale": float(torch.as_tensor(saved["scale"]).reshape(-1)[0]),
                    "clean_steps": int(saved["growth_tracker"]),
                    "hysteresis_left": int(saved["hysteresis_tracker"])}
    return None


def megatron_grad_scaler(state: dict) -> dict:
    """megalite's :class:`~megalite.optim.loss_scaler.DynamicLossScaler` state as the
    ``grad_scaler`` entry Megatron-Core's DynamicGradScaler loads."""
    return {"scale": torch.tensor([float(state["scale"])]),
            "growth_tracker": int(state["clean_steps"]),
            "hysteresis_tracker": int(state["hysteresis_left"])}


def _saved_groups(common: dict) -> list[dict]:
    """Every parameter group of the common state's optimizers."""
    return [g for inner in _optimizers(common) for g in inner["param_groups"]]


def lion_betas(common: dict) -> tuple[float, float] | None:
    """The betas a Megatron run's Lion stepped with, from its saved parameter groups (a
    Lion group: betas and no ``eps``; None: no Lion group saved). Megatron-Core 0.19.2's
    ``--optimizer lion`` takes them from --adam-beta1/2, not --lion-beta1/2."""
    betas = {tuple(g["betas"]) for g in _saved_groups(common)
             if "betas" in g and "eps" not in g}
    if len(betas) > 1:
        raise CheckpointError(f"the saved Lion parameter groups hold several betas "
                              f"{sorted(betas)}; megalite's Lion takes one pair")
    return betas.pop() if betas else None


def sharding_type(common: dict) -> str | None:
    """How the distributed optimizer saved its state (None: the plain optimizer's)."""
    meta = common.get("content_metadata") or {}
    saved = common.get("optimizer")
    if isinstance(saved, dict) and "param_state_sharding_type" in saved:
        return saved["param_state_sharding_type"]
    return meta.get("distrib_optim_sharding_type")


def unreadable(common: dict, keys) -> str | None:
    """Why the optimizer state of a checkpoint with ``common`` and optimizer tensor
    ``keys`` cannot be imported (None: it can, or there is none)."""
    if not common.get("optimizer_saved", "optimizer" in common):
        return None
    args = common.get("args")
    kind = sharding_type(common)
    if kind not in READABLE:
        return (f"its distributed optimizer state is saved as {kind!r}; "
                "load it in Megatron-LM and save it again with "
                "--dist-ckpt-optim-fully-reshardable")
    algorithm = getattr(args, "optimizer", "adam")
    if algorithm not in ALGORITHMS:
        return (f"its optimizer is --optimizer {algorithm}; megalite resumes Adam, SGD and "
                "Lion state")
    names = {_parts(k)[0] for k in keys if _parts(k)} | buckets.bucket_states(keys)
    missing = [n for n in ALGORITHMS[algorithm] if n not in names]
    if missing:
        return f"its {algorithm} state lacks {', '.join(missing)}"
    return None


def _step(common: dict, groups: list[dict]) -> int:
    """The optimizer's step count (SGD keeps none: the iteration's); ``groups``: the
    bucket format's saved parameter groups."""
    counted = buckets.step_count(groups)
    if counted is not None:
        return counted
    for inner in _optimizers(common):
        common_step = (inner.get("state") or {}).get("common_step")
        if common_step is not None:   # (a chained Lion has none: its Adam's)
            return int(common_step)
    counted = buckets.step_count(_saved_groups(common))
    return int(common.get("iteration", 0)) if counted is None else counted


def read_optimizer_state(common: dict, tensors: dict[str, torch.Tensor],
                         chunks: dict[str, list], model_cfg, weights: dict[str, torch.Tensor],
                         groups: list[dict], where: str) -> MegatronOptimizerState:
    """Megatron's optimizer state (``tensors``: the :func:`optimizer_keys` entries, full;
    ``chunks`` as for the weights; ``weights``: the saved model weights by Megatron key,
    which locate the bucket format's parameters; ``groups``: that format's saved
    ``param_groups``) for ``model_cfg``, in megalite's names. Call :func:`unreadable`
    first."""
    by_state: dict[str, dict[str, torch.Tensor]] = {}
    flat = {k: t for k, t in tensors.items() if buckets.KEY.match(k)}
    if flat:
        trained = {k: w for k, w in weights.items() if not k.endswith("expert_bias")}
        by_state = buckets.read_bucket_state(flat, trained, chunks, where)
    for key, t in tensors.items():
        if key not in flat:
            name, model_key = _parts(key)   # (a chained optimizer's prefix dropped)
            by_state.setdefault(name, {})[model_key] = t
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, saved in by_state.items():
        for param, t in mapping.to_megalite(saved, chunks, model_cfg).items():
            params.setdefault(param, {})[STATES[name]] = t
    args = common.get("args")
    scheduler = common.get("opt_param_scheduler") or {}
    return MegatronOptimizerState(
        step=_step(common, groups), params=params, iteration=int(common.get("iteration", 0)),
        consumed_samples=int(getattr(args, "consumed_train_samples", 0) or 0),
        scheduler_samples=scheduler.get("num_steps"), loss_scaler=loss_scaler(common))


def misplaced_masters(params: dict[str, dict[str, torch.Tensor]],
                      weights: dict[str, torch.Tensor], model_dtype: torch.dtype
                      ) -> str | None:
    """Where the saved fp32 main parameters (``master``: the distributed optimizer's
    ``param``, a bf16 / fp16 run's ``fp32_param``) are not the saved weights (Megatron
    copies each main parameter into its model weight after every step, cast to the
    model's dtype ``model_dtype``): ``"<name>, largest difference <d>; <n> of <m>
    parameters"``, or None where every one matches (or none is saved). ``params`` in
    megalite's names, as :func:`read_optimizer_state` gives them; ``weights`` the imported
    full weights (in any dtype that holds the model's values)."""
    bad = []
    for name, entry in params.items():
        master, weight = entry.get("master"), weights.get(name)
        if master is None or weight is None:
            continue
        cast = master.to(model_dtype).to(weight.dtype)
        if cast.shape != weight.shape or not torch.equal(cast, weight):
            diff = ((cast.float() - weight.float()).abs().max().item()
                    if cast.shape == weight.shape else float("nan"))
            bad.append((name, diff))
    if not bad:
        return None
    total = sum("master" in entry for entry in params.values())
    return f"{bad[0][0]}, largest difference {bad[0][1]:.3g}; {len(bad)} of {total} parameters"


# -- megalite -> Megatron ----------------------------------------------------------------------
# the torch optimizer's own settings in each of Megatron's saved parameter groups
TORCH_GROUP = {
    "adam": lambda o: {"betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps,
                       "amsgrad": False, "maximize": False, "foreach": None,
                       "capturable": False, "differentiable": False, "fused": None,
                       "decoupled_weight_decay": True},
    "sgd": lambda o: {"momentum": o.sgd_momentum, "dampening": 0, "nesterov": False,
                      "maximize": False, "foreach": None, "differentiable": False,
                      "fused": None},
    "lion": lambda o: {"betas": (o.lion_beta1, o.lion_beta2)},
}


@dataclass
class MegatronOptimizerOut:
    """megalite's optimizer state as a Megatron-Core checkpoint holds it: the ``tensors``
    (``optimizer.state.<state>.<sharded key>``, full) and what joins the common state
    (``common``: ``optimizer``, ``opt_param_scheduler``; ``metadata``: the content
    metadata naming the format; ``args``: the run's position)."""

    tensors: dict[str, torch.Tensor]
    common: dict
    metadata: dict
    args: dict


def not_exportable(cfg, distributed: bool, expert_parallel: bool = False) -> str | None:
    """Why the optimizer state of a run with ``cfg`` is not written for a Megatron-LM run
    with (``distributed``) or without the distributed optimizer, with experts over
    several ranks or not (``expert_parallel``) (None: it is)."""
    o, m = cfg.optim, cfg.model
    if o.optimizer not in TORCH_GROUP:
        return (f"its optimizer is --optimizer {o.optimizer}; megalite writes Megatron-LM's "
                "Adam, SGD and Lion state")
    if o.optimizer == "lion" and m.num_experts and expert_parallel and m.add_bias_linear:
        return ("at --expert-model-parallel-size above 1 Megatron-LM gives a Lion run's "
                "expert biases an Adam of their own, which megalite does not write; export "
                "for --target-expert-model-parallel-size 1")
    if o.optimizer == "sgd" and distributed:
        return ("Megatron-Core's distributed optimizer takes Adam, not SGD; export with "
                "--target-optimizer-format plain")
    if o.decoupled_lr is not None:
        return "--decoupled-lr gives Megatron parameter groups megalite does not write"
    return None


def _megatron_schedule(cfg, scheduler) -> dict:
    """The state of Megatron-LM's ``OptimizerParamScheduler`` for the run ``cfg`` at
    ``scheduler``'s position: what Megatron computes from the same flags (its lengths in
    samples), so that its load finds them equal."""
    o, t = cfg.optim, cfg.train
    gbs = t.global_batch_size
    if t.train_iters:
        decay = (o.lr_decay_iters or t.train_iters) * gbs
        incr = t.train_iters * gbs
        warmup = o.lr_warmup_iters * gbs
    else:
        decay = o.lr_decay_samples or t.train_samples
        incr = t.train_samples
        warmup = o.lr_warmup_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    steps = scheduler.num_steps * (1 if scheduler.unit == "samples" else gbs)
    return {"max_lr": o.lr, "lr_warmup_steps": warmup, "num_steps": steps,
            "lr_decay_style": o.lr_decay_style, "lr_decay_steps": decay, "min_lr": o.min_lr,
            "start_wd": o.weight_decay, "end_wd": o.weight_decay, "wd_incr_style": "constant",
            "wd_incr_steps": incr}


def _saved_optimizer(cfg, scheduler, step: int, distributed: bool, experts: bool,
                     wd_mults, algorithm: str | None = None,
                     scaler: dict | None = None) -> dict:
    """One Megatron optimizer's common state: its parameter groups (weight-decayed
    weights, then the norms and biases Megatron does not decay: ``wd_mult`` 1 and 0; the
    expert optimizer's marked ``is_expert_parallel``), which Megatron pairs with its own
    by those marks, the step count, and an fp16 run's ``grad_scaler`` (``scaler``: its
    :func:`megatron_grad_scaler`). ``algorithm``: the torch optimizer's, default the
    run's (the Adam that Megatron chains after a Lion marks its groups so)."""
    o = cfg.optim
    algorithm = algorithm or o.optimizer
    mark = {"optimizer": algorithm} if algorithm != o.optimizer else {}
    groups = [{"is_expert_parallel": experts, "default_config": True, "wd_mult": wd_mult,
               "lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": o.lr, "min_lr": o.min_lr,
               **mark, "lr": scheduler.lr_at(scheduler.num_steps),
               "weight_decay": o.weight_decay * wd_mult, **TORCH_GROUP[algorithm](o)}
              for wd_mult in wd_mults]
    scaled = {"grad_scaler": scaler} if scaler is not None else {}
    if distributed:
        return {"optimizer": {"param_groups": [{**g, "step": float(step)} for g in groups]},
                **scaled, "param_state_sharding_type": "fully_reshardable"}
    saved = {"param_groups": groups}
    if algorithm == "adam":
        saved["state"] = {"common_step": torch.tensor(float(step))}
    # a bf16 / fp16 model's optimizer keeps the torch optimizer's state one level down
    return {"optimizer": saved, **scaled} if cfg.model.bf16 or cfg.model.fp16 else saved


def to_megatron_optimizer(cfg, weights: dict[str, torch.Tensor], state: dict, scheduler,
                          padded_vocab: int, impl: str, distributed: bool,
                          expert_parallel: bool = False) -> MegatronOptimizerOut:
    """megalite's optimizer ``state`` (:func:`~megalite.checkpoint.consolidated.
    load_full_training_state`'s, full names) of the run ``cfg`` whose fp32 ``weights``
    they belong to -> what a Megatron-Core checkpoint holds for a run with
    (``distributed``: ``fully_reshardable``) or without the distributed optimizer, keys as
    :func:`.mapping.to_megatron` names the weights; ``expert_parallel``: a Megatron run
    whose experts are expert-parallel (ep > 1), which chains a dense and an expert
    optimizer, each with its own saved state. Call :func:`not_exportable` first.

    Lion is written as Megatron-Core 0.19.2 keeps it, with or without
    ``--use-distributed-optimizer``: a plain Lion over the linear weights (experts
    included) chained before a plain Adam over the rest; with ``expert_parallel`` the
    experts' Lion is a second one, between the two (its groups marked
    ``is_expert_parallel``)."""
    lion = cfg.optim.optimizer == "lion"
    requested, distributed = distributed, distributed and not lion
    by_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, entry in state["params"].items():
        for k, t in entry.items():
            by_state.setdefault(k, {})[name] = t
    # "master": a bf16 / fp16 run's fp32 weights; the distributed format holds an fp32
    # run's too, which are its weights
    main = "param" if distributed else "fp32_param"
    if distributed and "master" not in by_state:
        by_state["master"] = {n: weights[n] for n in state["params"]}
    m = cfg.model
    tensors = {}
    for k, full in by_state.items():
        target = main if k == "master" else k
        for key, t in mapping.to_megatron(full, m, padded_vocab, impl).items():
            tensors[f"{PREFIX}{target}.{key}"] = t.float().contiguous()
    metadata = ({"distrib_optim_sharding_type": "fully_reshardable",
                 "distrib_optim_fully_reshardable_mem_efficient": False} if distributed
                else {})
    # an fp16 run's dynamic loss scale, in each optimizer Megatron chains
    dynamic = m.fp16 and "clean_steps" in (state.get("loss_scaler") or {})
    scaler = megatron_grad_scaler(state["loss_scaler"]) if dynamic else None
    if lion:   # Lion's weights are all decayed; Adam's embedding and output layer are
        lions = [_saved_optimizer(cfg, scheduler, state["step"], False, experts, (1.0,),
                                  scaler=scaler)
                 for experts in ((False, True) if expert_parallel and m.num_experts
                                 else (False,))]
        adam = _saved_optimizer(cfg, scheduler, state["step"], False, False, (1.0, 0.0),
                                "adam", scaler=scaler)
        saved = dict(enumerate([*lions, adam]))
    elif expert_parallel and m.num_experts:
        # the expert optimizer's groups: its weights', and its biases' where it has them
        saved = {0: _saved_optimizer(cfg, scheduler, state["step"], distributed, False,
                                     (1.0, 0.0), scaler=scaler),
                 1: _saved_optimizer(cfg, scheduler, state["step"], distributed, True,
                                     (1.0, 0.0) if m.add_bias_linear else (1.0,),
                                     scaler=scaler)}
    else:
        saved = _saved_optimizer(cfg, scheduler, state["step"], distributed, False,
                                 (1.0, 0.0), scaler=scaler)
    return MegatronOptimizerOut(
        tensors=tensors,
        common={"optimizer": saved, "opt_param_scheduler": _megatron_schedule(cfg, scheduler)},
        metadata=metadata,
        args={**arguments.run_args(cfg), "consumed_train_samples": state["consumed_samples"],
              "no_save_optim": False, "use_distributed_optimizer": requested})
