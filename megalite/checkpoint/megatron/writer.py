"""megalite's full state dict -> a Megatron-Core ``torch_dist`` checkpoint, in one process.

The checkpoint is what Megatron-LM's ``save_checkpoint`` writes for a model without RNG
state, with the optimizer state in a per-parameter format (:mod:`.optimizer`) or without
it: one ``torch.distributed.checkpoint`` directory whose tensors carry their global shapes
(Megatron-Core reshards on load, so any tp / pp reads it), the layers stacked ``[L, ...]``
under Megatron's sharded keys (:mod:`.mapping`), the empty ``_extra_state`` entries its
linear layers declare, and the common state (``args``, ``iteration``,
``checkpoint_version``; ``optimizer`` and ``opt_param_scheduler`` with the optimizer) as
the DCP entry ``common_state``::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_NNNNNNN/{metadata.json, .metadata, __0_0.distcp}

Megatron-LM loads it with ``--load SAVE --ckpt-format torch_dist`` and the run's flags:
with the optimizer state it resumes the run; without, ``--finetune`` starts one from the
weights.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings

import torch

from megalite.checkpoint.megatron import mapping
from megalite.checkpoint.megatron.arguments import megatron_args
from megalite.checkpoint.megatron.files import METADATA, TRACKER
from megalite.checkpoint.megatron.optimizer import MegatronOptimizerOut

CHECKPOINT_VERSION = 3.0
EXPERTS = "mlp.experts.experts."


def _extra_states(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, list]:
    """The ``_extra_state`` objects (``[None]`` outside fp8) Megatron's linear layers (the
    ``linear_*`` modules and a prediction depth's ``eh_proj``) save, one per layer (and
    expert), keyed as its ShardedObjects are: ``<module>._extra_state/shard_<layer>_<L>``
    (``shard_<layer>.<e>_<L>.<E>`` for experts) for stacked layers,
    ``<module>._extra_state/shard_0_1`` (``shard_<e>_<E>``) for a per-layer key
    (``decoder.layers.<i>.``, ``mtp.layers.<k>.``)."""
    out = {}
    for key, t in tensors.items():
        module = key.removesuffix(".weight")
        last = module.rsplit(".", 1)[-1]
        parsed = mapping.layer_key(key)
        if module == key or not (last.startswith("linear_") or last == "eh_proj") or (
                parsed is None and mapping.mtp_key(key) is None):
            continue
        name = f"{module}._extra_state"
        if parsed is None or parsed[0] is not None:   # one layer's key
            if EXPERTS in module:
                experts = t.shape[0]
                out.update({f"{name}/shard_{e}_{experts}": [None] for e in range(experts)})
            else:
                out[f"{name}/shard_0_1"] = [None]
            continue
        for i in range(num_layers):
            if EXPERTS in module:
                experts = t.shape[1]
                out.update({f"{name}/shard_{i}.{e}_{num_layers}.{experts}": [None]
                            for e in range(experts)})
            else:
                out[f"{name}/shard_{i}_{num_layers}"] = [None]
    return out


def _sharded_object(data: list) -> io.BytesIO:
    """A Megatron ``ShardedObject``'s entry as its checkpoints store it: the ``torch.save``
    of the list of its shards' data, as bytes (:func:`_planner` writes them as they are;
    ``torch.distributed.checkpoint`` would walk a list or dict given as such, making its
    integer keys strings)."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return buffer


def _planner():
    """``torch.distributed.checkpoint``'s save planner, not flattening the state dict and
    writing a ``BytesIO`` entry's bytes as they are (its default pickles the buffer)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class RawBytes(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            if isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    return RawBytes(flatten_state_dict=False)


def write_megatron(cfg, full: dict[str, torch.Tensor], root: str, iteration: int,
                   tp: int = 1, pp: int = 1, impl: str = mapping.TE,
                   optimizer: MegatronOptimizerOut | None = None, ep: int = 1) -> str:
    """Write ``full`` (names as ``GPTModel.full_state_dict()``) of the model ``cfg.model``
    as iteration ``iteration`` of a Megatron torch_dist checkpoint under ``root``
    (vocabulary padded as Megatron pads it at ``tp``; ``tp`` / ``pp`` are recorded in the
    args), its norms named as the layer spec of ``--transformer-impl impl`` loads them,
    with ``optimizer`` (:func:`.optimizer.to_megatron_optimizer`) the optimizer state and
    the lr schedule's position that Megatron-LM resumes from (``ep``: the expert-parallel
    size it was written for, recorded). Returns the iteration directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    m = cfg.model
    tensors = mapping.to_megatron(full, m, m.padded_vocab_size(tp), impl)
    state: dict = dict(tensors)
    state.update(_extra_states(tensors, m.num_layers))
    args = megatron_args(cfg, tp, pp, impl)
    if cfg.model.num_experts:
        args.expert_model_parallel_size = ep
    args.no_save_optim, args.no_save_rng = True, True
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
              "iteration": iteration, "num_floating_point_operations_so_far": 0,
              "content_metadata": {"singleton_local_shards": False,
                                   "chained_optim_avoid_prefix": True}}
    if optimizer is not None:
        state.update(optimizer.tensors)
        common.update(optimizer.common)
        common["content_metadata"].update(optimizer.metadata)
        vars(args).update(optimizer.args)
    state["common_state/shard_0_1"] = _sharded_object([common])
    directory = os.path.join(root, f"iter_{iteration:07d}")
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        # not flattened: each object (the common state, an extra state) is one entry
        dcp.save(state, storage_writer=FileSystemWriter(directory), no_dist=True,
                 planner=_planner())
    with open(os.path.join(directory, METADATA), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    tracker = os.path.join(root, TRACKER)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
    os.replace(tracker + ".tmp", tracker)
    return directory
