"""What a checkpoint holds, as the flat DCP state dict of one rank.

Keys (``<piece>`` is a global tensor key of :mod:`megalite.checkpoint.layout`)::

    model/<piece>             parameter blocks, and persistent buffers (a router's
                              ``expert_bias``) whole
    optim/<state>/<piece>     optimizer state of the same shape as the parameter, sharded
                              like it: exp_avg, exp_avg_sq (AdamW), momentum_buffer (SGD),
                              master (fp32 copy under bf16/fp16); under Muon each parameter
                              has its own rule's: momentum_buffer for the matrices, Adam's
                              moments for the rest
    common                    {format, iteration, consumed_samples, scheduler, loss_scaler,
                               optimizer: {step, state_names}} -- the same on every rank
    rng/<global rank>         that rank's RNG states (restored only on the same layout)
    fp8/<module>.amax_history delayed fp8 scaling's amax history ``[3, history_len]`` of
                              each fp8 linear (input, weight, grad rows; newest first);
                              the same on every rank holding the layer, so stored whole

Optimizer state goes through the optimizers' per-parameter form (both the plain and the
distributed optimizer, see :mod:`megalite.optim.optimizer_state`): ``{"step": int,
"params": {name in its chunk: {state name: tensor of the parameter's local shape}}}``;
the distributed optimizer gathers its data-parallel shards for it (a collective).
"""

from __future__ import annotations

import torch

from megalite.checkpoint.layout import ParamLayout, Piece
from megalite.layers.fp8.scaling import delayed_scalings
from megalite.pipeline.layout import model_chunks

FORMAT = "megalite-dcp-v1"
COMMON = "common"


def model_key(piece_key: str) -> str:
    return f"model/{piece_key}"


def optim_key(state_name: str, piece_key: str) -> str:
    return f"optim/{state_name}/{piece_key}"


def rng_key(rank: int) -> str:
    return f"rng/{rank:05d}"


def fp8_key(module_name: str) -> str:
    return f"fp8/{module_name}.amax_history"


def fp8_histories(model) -> list[tuple[str, object]]:
    """(checkpoint key, :class:`~megalite.layers.fp8.Fp8Scaling`) of every delayed-scaling
    linear of ``model``; module names without the chunk index (layer numbers are global)."""
    out = []
    for name, scaling in delayed_scalings(model_chunks(model)):
        out.append((fp8_key(name.split(".", 1)[1]), scaling))
    return out


def _whole(key: str, shape) -> Piece:
    shape = tuple(shape)
    return Piece(key, shape, (0,) * len(shape), shape)


def add_fp8_histories(state: dict, pieces: dict, model) -> None:
    """The delayed-scaling histories of ``model``, each one whole tensor."""
    for key, scaling in fp8_histories(model):
        state[key] = scaling.amax_history.detach()
        pieces[key] = _whole(key, scaling.amax_history.shape)


def fp8_load_state(model, saved: dict) -> tuple[dict, dict, list]:
    """Fresh tensors for the saved histories (``saved``: key -> saved shape) of this
    model's delayed-scaling linears; (blocks, pieces, [(scaling, tensor)]) for
    :func:`restore_fp8_histories` after the read. A history the checkpoint lacks (saved
    without delayed scaling) stays empty."""
    state, pieces, pairs = {}, {}, []
    for key, scaling in fp8_histories(model):
        if key in saved:
            tensor = torch.zeros(saved[key], dtype=torch.float32,
                                 device=scaling.amax_history.device)
            state[key], pieces[key] = tensor, _whole(key, saved[key])
            pairs.append((scaling, tensor))
    return state, pieces, pairs


def restore_fp8_histories(pairs: list) -> None:
    """Copy each loaded history into its linear: the newest ``min(saved, current)``
    entries of a history saved with another ``--fp8-amax-history-len``."""
    for scaling, tensor in pairs:
        n = min(tensor.shape[1], scaling.amax_history.shape[1])
        scaling.amax_history.zero_()
        scaling.amax_history[:, :n] = tensor[:, :n]
        scaling.step_amax.zero_()


# -- save ---------------------------------------------------------------------------------
def add_param_blocks(state: dict, pieces: dict, layout: ParamLayout, tensor: torch.Tensor,
                     prefix) -> None:
    """``state[prefix(piece key)] = block`` for each piece of ``layout`` (tensor: the
    parameter or a tensor of its local shape)."""
    for piece in layout.pieces:
        key = prefix(piece.key)
        state[key] = piece.view(tensor.detach())
        pieces[key] = piece


def save_state(layouts: list[ParamLayout], optimizer, common: dict, rng: dict | None,
               rank: int) -> tuple[dict, dict[str, Piece], list[str]]:
    """(state dict, pieces by key, optimizer state names) of this rank to save."""
    state: dict = {}
    pieces: dict[str, Piece] = {}
    names: set[str] = set()
    per_param = optimizer.state_dict_per_param() if optimizer is not None else None
    for layout in layouts:
        if not layout.saved:
            continue
        add_param_blocks(state, pieces, layout, layout.param, model_key)
        if per_param is None:
            continue
        for state_name, tensor in per_param["params"].get(layout.local_name, {}).items():
            names.add(state_name)
            add_param_blocks(state, pieces, layout, tensor,
                             lambda k, s=state_name: optim_key(s, k))
    common = dict(common)
    if per_param is not None:
        common["optimizer"] = {"step": int(per_param["step"]), "state_names": sorted(names)}
    state[COMMON] = common
    if rng is not None:
        state[rng_key(rank)] = rng
    return state, pieces, sorted(names)


# -- load ---------------------------------------------------------------------------------
def model_load_state(layouts: list[ParamLayout]) -> tuple[dict, dict[str, Piece]]:
    """Blocks that are views of the parameters: loading fills the model in place."""
    state: dict = {}
    pieces: dict[str, Piece] = {}
    for layout in layouts:
        if layout.mirror is None:   # a mirror takes its embedding's values afterwards
            add_param_blocks(state, pieces, layout, layout.param.data, model_key)
    return state, pieces


def optimizer_load_state(layouts: list[ParamLayout], state_names: list[str], dtypes: dict
                         ) -> tuple[dict, dict[str, Piece], dict]:
    """Fresh local tensors for the optimizer state ``state_names``; returns (blocks to
    load, pieces, ``params`` of the per-parameter form, whose tensors the blocks are
    views of; trainable parameters only).
    ``dtypes``: saved dtype by key."""
    state: dict = {}
    pieces: dict[str, Piece] = {}
    params: dict = {}
    for layout in layouts:
        if not layout.param.requires_grad or layout.mirror is not None:
            continue   # a buffer (expert bias): no optimizer state; a mirror: copied later
        entry = {}
        for name in state_names:
            keys = [optim_key(name, p.key) for p in layout.pieces]
            if not any(k in dtypes for k in keys):
                continue   # a state this parameter does not keep (Muon: per parameter)
            dtype = next(dtypes[k] for k in keys if k in dtypes)
            tensor = torch.zeros(layout.param.shape, dtype=dtype, device=layout.param.device)
            add_param_blocks(state, pieces, layout, tensor,
                             lambda k, s=name: optim_key(s, k))
            entry[name] = tensor
        params[layout.local_name] = entry
    return state, pieces, params
