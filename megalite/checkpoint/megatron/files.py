"""Megatron-LM checkpoint directories, read in one process without torch.distributed.

A Megatron-LM ``--save`` directory::

    SAVE/
      latest_checkpointed_iteration.txt    "1000" (or "release")
      iter_0001000/                        (or release/)
        metadata.json                      {"sharded_backend": "torch_dist", ...}
        .metadata  __0_0.distcp ...        torch.distributed.checkpoint files
        common.pt                          args, iteration (older Megatron-Core; newer
                                           ones keep it in the DCP entry ``common_state``)
      iter_0000500/mp_rank_00_000/model_optim_rng.pt    the legacy per-rank format

:func:`find_checkpoint` resolves a directory and an optional step to one iteration's
directory and its format; :func:`read_common` gives the common state (Megatron's ``args``
namespace, the iteration, the checkpoint version); :func:`read_tensors` reads full
(unsharded) tensors by their sharded key, whatever tp / pp / ep the job saved with.
Pickled objects are read by a restricted unpickler: classes it does not allow (Megatron's
enums, its config objects) come back as inert stand-ins, so nothing runs and
megatron-core need not be installed.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pathlib
import pickle
import types
import warnings
from dataclasses import dataclass

import torch

from megalite.checkpoint.files import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
DCP_METADATA = ".metadata"
COMMON_PT = "common.pt"
COMMON_KEY = "common_state"
LEGACY_FILE = "model_optim_rng.pt"


@dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron-LM checkpoint: its directory, iteration (``None`` for
    ``release``) and format (``torch_dist`` or ``legacy``)."""

    directory: str
    iteration: int | None
    format: str


def _iteration_name(iteration: int | None) -> str:
    return "release" if iteration is None else f"iter_{iteration:07d}"


def _held(root: str) -> list[str]:
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return [n for n in names if (n.startswith("iter_") and n[5:].isdigit()) or n == "release"]


def _format_of(directory: str) -> str | None:
    """``torch_dist``, ``legacy`` or None (neither) for an iteration directory."""
    meta = {}
    if os.path.exists(os.path.join(directory, METADATA)):
        try:
            with open(os.path.join(directory, METADATA)) as f:
                meta = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{directory}/{METADATA} cannot be read: {exc}") from None
    if str(meta.get("format", "")).startswith("megalite"):
        raise CheckpointError(f"{directory} is a megalite checkpoint, not a Megatron-LM one "
                              f"(use --source megalite)")
    if os.path.exists(os.path.join(directory, DCP_METADATA)):
        return "torch_dist"
    if meta:
        raise CheckpointError(f"{directory}: Megatron sharded backend "
                              f"{meta.get('sharded_backend')!r} is not supported (megalite "
                              f"reads torch_dist)")
    if any(n.startswith("mp_rank_") for n in os.listdir(directory)):
        return "legacy"
    return None


def find_checkpoint(root: str, step: int | None = None) -> MegatronCheckpoint:
    """The iteration ``step`` (default: the one ``latest_checkpointed_iteration.txt``
    names) of the Megatron checkpoint under ``root``; ``root`` may also be an iteration
    directory itself. ``CheckpointError`` in one line when it is none."""
    if not os.path.isdir(root):
        what = "is a file" if os.path.exists(root) else "does not exist"
        raise CheckpointError(f"{root}: the directory {what}")
    base = os.path.basename(os.path.normpath(root))
    if step is None and (base.startswith("iter_") or base == "release"):
        found = _format_of(root)
        if found:
            return MegatronCheckpoint(root, None if base == "release" else int(base[5:]), found)
    held = _held(root)
    if step is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.exists(tracker):
            hint = ("holds iterations " + ", ".join(held) + f" but no {TRACKER}; choose one "
                    "with --ckpt-step" if held else self_description(root))
            raise CheckpointError(f"{root} is not a Megatron-LM checkpoint: it {hint}")
        with open(tracker) as f:
            text = f.read().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker} holds {text!r}, not an iteration")
        step = None if text == "release" else int(text)
        name = _iteration_name(step)
    else:
        name = _iteration_name(step)
        if name not in held:
            what = ("available: " + ", ".join(held)) if held else "it holds no iteration"
            raise CheckpointError(f"{root} has no Megatron iteration {step}; {what}")
    directory = os.path.join(root, name)
    found = _format_of(directory) if os.path.isdir(directory) else None
    if found is None:
        raise CheckpointError(f"{directory}: neither torch_dist files ({DCP_METADATA}) nor "
                              f"legacy mp_rank_* directories")
    return MegatronCheckpoint(directory, step, found)


def self_description(root: str) -> str:
    """What ``root`` holds instead of a Megatron checkpoint, for an error message."""
    if os.path.exists(os.path.join(root, "config.json")):
        return "looks like a Hugging Face model"
    if any(n.startswith("iter_") and n.endswith(".tmp") for n in os.listdir(root)) or \
            os.path.exists(os.path.join(root, ".megalite.lock")):
        return "looks like a megalite checkpoint (use --source megalite)"
    return f"holds neither {TRACKER} nor iter_*/ directories"


# -- pickles -----------------------------------------------------------------------------------
class _Opaque:
    """Stand-in for a class the restricted unpickler does not load."""

    _name = "?"

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self._name}{self.args!r}>"


_SAFE = {("collections", "OrderedDict"), ("argparse", "Namespace"),
         ("types", "SimpleNamespace"), ("torch", "Size"), ("torch", "device"),
         ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
         # a tensor saved with attributes of its own (Megatron's fp32 main weights carry
         # their tensor-parallel attributes): rebuilt as a plain tensor
         ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"),
         ("torch._tensor", "Tensor")} | {
    ("builtins", n) for n in ("set", "frozenset", "slice", "complex", "range", "bytearray",
                              "tuple", "list", "dict", "int", "float", "str", "bool")}
_MODULES = {"collections": collections, "argparse": argparse, "types": types,
            "pathlib": pathlib, "torch": torch, "torch._tensor": torch._tensor}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE:
            if module == "builtins":
                return __builtins__[name] if isinstance(__builtins__, dict) else getattr(
                    __builtins__, name)
            return getattr(_MODULES[module], name)
        if module == "torch._utils" and name.startswith("_rebuild"):
            return getattr(torch._utils, name)
        if module == "torch" and (name.endswith("Storage") or
                                  isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        return type(name, (_Opaque,), {"_name": f"{module}.{name}"})


_PICKLE = types.ModuleType("megalite_restricted_pickle")
_PICKLE.Unpickler = _RestrictedUnpickler
_PICKLE.load = lambda f, **kw: _RestrictedUnpickler(f, **kw).load()
_PICKLE.__name__ = "megalite_restricted_pickle"


def load_pickled(source) -> object:
    """``torch.load`` of a file or bytes with the restricted unpickler (tensors on CPU)."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    return torch.load(source, map_location="cpu", weights_only=False, pickle_module=_PICKLE)


# -- torch_dist --------------------------------------------------------------------------------
def dcp_metadata(directory: str):
    """The ``torch.distributed.checkpoint`` metadata of a torch_dist iteration directory."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a damaged .metadata: one line, not a pickle traceback
        raise CheckpointError(f"{directory}/{DCP_METADATA} cannot be read: {exc}") from None


def read_common(ckpt: MegatronCheckpoint) -> dict:
    """The common state Megatron saved beside the tensors: ``args`` (an
    ``argparse.Namespace``), ``iteration``, ``checkpoint_version``, ..."""
    path = os.path.join(ckpt.directory, COMMON_PT)
    if os.path.exists(path):
        state = load_pickled(path)
    else:
        md = dcp_metadata(ckpt.directory)
        entries = [(i, s) for i, s in md.storage_data.items()
                   if i.fqn.startswith(COMMON_KEY)]
        if not entries:
            if any(k == "args" or k.startswith("model.") for k in md.state_dict_metadata):
                raise CheckpointError(
                    f"{ckpt.directory} is a Megatron-LM torch_dcp or fsdp_dtensor checkpoint "
                    "(Megatron-FSDP's formats); megalite reads torch_dist and legacy ones: "
                    f"convert it in Megatron-LM with --load {os.path.dirname(ckpt.directory)} "
                    "--ckpt-convert-format torch_dist --ckpt-convert-save <dir>")
            raise CheckpointError(f"{ckpt.directory} holds neither {COMMON_PT} nor a "
                                  f"{COMMON_KEY} entry: no Megatron args to build the model")
        state = _object(ckpt.directory, entries[0][1])
        if isinstance(state, list):  # one per saving rank; they are equal
            state = state[0]
    if not isinstance(state, dict) or "args" not in state:
        raise CheckpointError(f"{ckpt.directory}: the common state holds no Megatron args")
    return state


def _object(directory: str, info) -> object:
    """The pickled object a DCP storage entry ``info`` points at."""
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return load_pickled(f.read(info.length))


def read_objects(ckpt: MegatronCheckpoint, pattern) -> list:
    """The saved objects (Megatron's ``ShardedObject``s, one entry per saving shard) whose
    keys, before the ``/shard_..`` part, match the compiled regular expression
    ``pattern``."""
    md = dcp_metadata(ckpt.directory)
    return [_object(ckpt.directory, info) for index, info in sorted(
                md.storage_data.items(), key=lambda e: e[0].fqn)
            if pattern.match(index.fqn.split("/")[0])]


def tensor_shapes(ckpt: MegatronCheckpoint) -> dict[str, tuple[torch.Size, list]]:
    """Sharded key -> (global shape, chunks' (offsets, sizes)) of every tensor entry."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp_metadata(ckpt.directory)
    return {k: (v.size, [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
            for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def read_tensors(ckpt: MegatronCheckpoint, keys) -> dict[str, torch.Tensor]:
    """Full tensors of the sharded ``keys`` (fp32 as saved, or the saved dtype), read with
    ``torch.distributed.checkpoint.load`` in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = dcp_metadata(ckpt.directory)
    state = {k: torch.empty(md.state_dict_metadata[k].size,
                            dtype=md.state_dict_metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(ckpt.directory), no_dist=True)
    return state
