"""The optimizer state in Megatron-LM's legacy per-rank files (``--ckpt-format torch``),
placed by parameter name, so that :mod:`.legacy` merges it across ranks as it merges the
weights and :mod:`.optimizer` reads it as it reads ``torch_dist`` state.

Each rank's ``model_optim_rng.pt`` holds its torch optimizer's ``state_dict()``: per-parameter
state keyed by an index, and ``param_groups`` whose ``params`` list those indices (a bf16 /
fp16 run wraps it as ``{"optimizer": ..., "fp32_from_fp16_params": [[main weights of each
group]], "grad_scaler": ...}``). Megatron-Core numbers the parameters group by group: a
group is every parameter with the same overrides (``wd_mult``, ``lr_mult``,
``is_decoupled_lr``) and expert flag, taken in the model chunks' ``named_parameters()``
order, which is the order of the rank's saved model state dict. So the index of each
parameter follows from its name and shape alone: its weight decay is off for biases and
1-D tensors (Megatron's default), its lr decoupled for the embedding and output layer
under ``--decoupled-lr``; every group's count and every state's shape are checked against
the saved weights, and a file that does not fit is not imported (:class:`Unplaced`).

A chained optimizer (Megatron chains a dense and an expert optimizer for MoE models)
saves a list of those, each numbering its own parameters: its groups' expert flag tells
which parameters are whose.

The distributed optimizer keeps its state beside, in each model-parallel rank's
``distrib_optim.pt``: ``{gbuf index: {(param dtype, grad dtype): {"param", "exp_avg",
"exp_avg_sq": one flat fp32 tensor over the gradient buffer, its buckets coalesced}}}``
(gathered over dp; an MoE run's chained optimizers save a list of two, the dense
buffers', gathered over dp, and the experts', over the expert data-parallel group), and
its ``model_optim_rng.pt`` only the parameter groups (with their ``step``). Its
parameters are found in the buffers by their values, the main weights ``param`` being the
rank's saved weights in fp32, as :mod:`.buckets` finds them in ``torch_dist``'s
per-bucket tensors. Not placed: ``--optimizer lion``'s chained Lion and Adam (whose
groups the overrides do not tell apart).
"""

from __future__ import annotations

import re

import torch

from megalite.checkpoint.files import CheckpointError

PER_PARAMETER = ("exp_avg", "exp_avg_sq", "momentum_buffer")
BUFFERS = ("expert_bias", "local_tokens_per_expert")   # saved beside parameters, not trained
EXPERT = re.compile(r"\.mlp\.experts\.")
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


class Unplaced(Exception):
    """Why a legacy file's optimizer state cannot be placed (the import keeps the weights)."""


def _is_parameter(key: str) -> bool:
    return "_extra_state" not in key and not key.endswith(BUFFERS)


def _group_of(key: str, tensor: torch.Tensor, args) -> tuple:
    """(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) of parameter ``key``."""
    no_decay = key.endswith(".bias") or tensor.dim() == 1
    decoupled = getattr(args, "decoupled_lr", None) is not None and \
        key.endswith(EMBEDDING_OR_OUTPUT)
    return (0.0 if no_decay else 1.0, 1.0, bool(EXPERT.search(key)), decoupled)


def _saved_group(group: dict) -> tuple:
    return (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)),
            bool(group.get("is_expert_parallel", False)),
            bool(group.get("is_decoupled_lr", False)))


def _unwrap(saved) -> tuple[dict, list | None]:
    """(the torch optimizer's state dict, the fp32 main weights per group or None) of one
    optimizer."""
    if isinstance(saved, dict) and "param_groups" in saved:
        return saved, None
    if isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict) \
            and "param_groups" in saved["optimizer"]:
        return saved["optimizer"], saved.get("fp32_from_fp16_params")
    raise Unplaced("its rank files hold an optimizer state of an unknown layout")


def _parts(saved) -> list:
    """The optimizers of one rank's saved state: one, or a chained optimizer's list."""
    return list(saved) if isinstance(saved, (list, tuple)) else [saved]


def _rank(saved, chunks: list[dict], args) -> dict[str, list[dict]]:
    """One rank's state: {state name: per model chunk {model key: tensor}}."""
    members: dict[tuple, list[tuple[int, str, torch.Tensor]]] = {}
    for v, chunk in enumerate(chunks):
        for key, weight in chunk.items():
            if _is_parameter(key):
                members.setdefault(_group_of(key, weight, args), []).append((v, key, weight))
    out: dict[str, list[dict]] = {}
    placed = 0
    for part in _parts(saved):
        placed += _place(part, members, out, len(chunks))
    if placed != sum(len(m) for m in members.values()):
        raise Unplaced("its parameter groups do not cover every saved weight")
    return out


def _place(saved, members: dict, out: dict, num_chunks: int) -> int:
    """Put one optimizer's per-parameter state into ``out`` (as :func:`_rank` returns it)
    by its groups' ``members``; the number of parameters placed."""
    torch_state, masters = _unwrap(saved)
    placed = 0
    for g, group in enumerate(torch_state["param_groups"]):
        params = members.get(_saved_group(group), [])
        if len(params) != len(group["params"]):
            raise Unplaced(f"its parameter group {g} holds {len(group['params'])} parameters "
                           f"where the rank's weights give {len(params)}")
        for j, ((v, key, weight), index) in enumerate(zip(params, group["params"])):
            entry = dict(torch_state["state"].get(index, {}))
            if masters is not None:
                entry["fp32_param"] = masters[g][j]
            for name, t in entry.items():
                if name not in (*PER_PARAMETER, "fp32_param"):
                    continue
                if not isinstance(t, torch.Tensor) or t.shape != weight.shape:
                    raise Unplaced(f"its {name} of parameter index {index} does not have the "
                                   f"shape of {key} {tuple(weight.shape)}")
                out.setdefault(name, [{} for _ in range(num_chunks)])[v][key] = t.float()
        placed += len(params)
    return placed


def _step(saved) -> int:
    """The optimizer's step count: any parameter's ``step`` (0 with none, as SGD's)."""
    torch_state, _ = _unwrap(saved)
    for entry in torch_state["state"].values():
        if "step" in entry:
            return int(torch.as_tensor(entry["step"]).item())
    return 0


def _common(saved) -> dict:
    """One optimizer's entry of the common state :mod:`.optimizer` reads: its parameter
    groups, its step as ``common_step`` and an fp16 run's ``grad_scaler``."""
    torch_state, _ = _unwrap(saved)
    inner = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                              for g in torch_state["param_groups"]],
             "state": {"common_step": _step(saved)}}
    if isinstance(saved, dict) and "grad_scaler" in saved:
        return {"optimizer": inner, "grad_scaler": saved["grad_scaler"]}
    return inner


def _distributed_common(saved) -> dict:
    """One distributed optimizer's entry of the common state (as :func:`_common`): its
    saved parameter groups, which carry the step, and an fp16 run's ``grad_scaler``."""
    groups = [dict(g) for g in _unwrap(saved)[0]["param_groups"]]
    scaler = {"grad_scaler": saved["grad_scaler"]} if "grad_scaler" in saved else {}
    return {"optimizer": {"param_groups": groups}, **scaler}


def _held(saved, optimizers) -> set[bool] | None:
    """Whose parameters a rank's ``distrib_optim.pt`` (``saved``) holds state for, as the
    expert flags of its optimizers (None: every parameter's). A chained optimizer's list
    has None where this rank saved none of that optimizer's state: each optimizer's
    buffers are saved by the first rank of its data-parallel group, so an ep rank > 0
    holds the experts' alone (the dense state is ep rank 0's)."""
    parts = _parts(saved)
    if len(parts) == 1 and parts[0] is not None:
        return None
    groups = [_unwrap(part)[0]["param_groups"] for part in _parts(optimizers)]
    if len(groups) != len(parts):
        raise Unplaced(f"its distrib_optim.pt holds {len(parts)} optimizers where "
                       f"model_optim_rng.pt has {len(groups)}")
    held = set()
    for part, part_groups in zip(parts, groups):
        flags = {bool(g.get("is_expert_parallel", False)) for g in part_groups}
        if len(flags) != 1:
            raise Unplaced("a chained optimizer mixes expert and dense parameter groups")
        if part is not None:
            held |= flags
    return held


def _distributed_rank(saved, optimizers, chunks: list[dict], where: str
                      ) -> dict[str, list[dict]]:
    """One rank's distributed-optimizer state (its ``distrib_optim.pt``, ``saved``: one
    optimizer's buffers, or a chained optimizer's list of them; ``optimizers``: its
    ``model_optim_rng.pt``'s optimizer entry, the groups) as {state name: per model chunk
    {model key: tensor}} of the parameters it holds state for (:func:`_held`), each found
    in the flat buffers by its values (:func:`.buckets.place_buckets`, each buffer one
    bucket)."""
    from megalite.checkpoint.megatron import buckets

    held = _held(saved, optimizers)
    weights = {f"{v}/{key}": w for v, chunk in enumerate(chunks) for key, w in chunk.items()
               if _is_parameter(key)
               and (held is None or bool(EXPERT.search(key)) in held)}
    local = {k: [((0,) * w.dim(), tuple(w.shape))] for k, w in weights.items()}
    flat = {f"optimizer {i} gbuf {g} {dtypes}": {name: t for name, t in states.items()
                                                 if isinstance(t, torch.Tensor)}
            for i, part in enumerate(_parts(saved)) if part is not None   # (chained: a list)
            for g, by_dtype in part.items() if isinstance(g, int)   # (not "buckets_coalesced")
            for dtypes, states in by_dtype.items()}
    try:
        found = buckets.place_buckets(flat, weights, local, where)
    except CheckpointError as exc:
        raise Unplaced(str(exc).split(": ", 1)[-1]) from None
    out: dict[str, list[dict]] = {}
    for name, by_key in found.items():
        per_chunk = out.setdefault("fp32_param" if name == "param" else name,
                                   [{} for _ in chunks])
        for tagged, t in by_key.items():
            v, key = tagged.split("/", 1)
            per_chunk[int(v)][key] = t
    return out


def rank_states(saved: dict, ranks: dict, args, distributed: dict | None = None
                ) -> tuple[dict[str, dict], dict]:
    """({state name: {(tp, pp, ep) rank: per chunk {model key: tensor}}}, the common state's
    ``optimizer`` entry as :mod:`.optimizer` reads it: the parameter groups, the step count
    as ``common_step`` and an fp16 run's ``grad_scaler``) from every rank's saved optimizer
    ``saved`` and model chunks ``ranks`` (``distributed``: each rank's
    ``distrib_optim.pt``, under the distributed optimizer). :class:`Unplaced` where it
    does not fit."""
    if getattr(args, "optimizer", "adam") == "lion":
        raise Unplaced("--optimizer lion chains a Lion and an Adam, whose parameters its "
                       "legacy files do not tell apart")
    by_state: dict[str, dict] = {}
    if getattr(args, "use_distributed_optimizer", False):
        if not distributed or distributed.keys() != ranks.keys():
            raise Unplaced("its distributed optimizer's distrib_optim.pt files are missing")
        for rank, chunks in ranks.items():
            for name, per_chunk in _distributed_rank(distributed[rank], saved[rank], chunks,
                                                     f"rank {rank}").items():
                by_state.setdefault(name, {})[rank] = per_chunk
        # each optimizer's groups with their step, an fp16 run's scaler
        parts = [_distributed_common(part) for part in _parts(saved[(0, 0, 0)])]
        return by_state, parts[0] if len(parts) == 1 else dict(enumerate(parts))
    for rank, chunks in ranks.items():
        for name, per_chunk in _rank(saved[rank], chunks, args).items():
            by_state.setdefault(name, {})[rank] = per_chunk
    for name, per_rank in by_state.items():
        if per_rank.keys() != ranks.keys():
            raise Unplaced(f"its {name} is missing on some ranks")
    parts = [_common(part) for part in _parts(saved[(0, 0, 0)])]
    return by_state, parts[0] if len(parts) == 1 else dict(enumerate(parts))
