"""Megatron-LM's legacy per-rank checkpoints (``--ckpt-format torch``), merged in one
process into the global, layer-stacked tensors a ``torch_dist`` checkpoint holds, so the
same key mapping (:mod:`.mapping`) applies::

    iter_0001000/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt    tp rank, pp rank, ep rank
    iter_0001000/mp_rank_TT[_PPP[_EEE]]/distrib_optim.pt      (--use-distributed-optimizer)

Each file holds its rank's ``model`` state dict (``model0``, ``model1``, ... under virtual
pipelining) with stage-local layer numbers and its tensor-parallel shards, next to
``args``, ``iteration`` and ``checkpoint_version``. Merging:

* layers: a stage's local layers follow the earlier stages' (for each virtual chunk in
  turn, then each stage: Megatron's interleaved order), so uneven splits need no args;
* tensor parallel: column-parallel weights (``linear_qkv``, ``linear_fc1`` and the shared
  experts', multi-latent attention's ``linear_q_proj`` / ``linear_q_up_proj`` /
  ``linear_kv_up_proj`` and, under the local spec only, its down projections, the
  embedding and output layer, ``[out/tp, in]``) concatenate along dim 0, SwiGLU's
  ``linear_fc1`` as gate and up halves separately; row-parallel ones (``linear_proj``,
  ``linear_fc2``, ``[out, in/tp]``) along dim 1; everything else (norms, QK norms, row
  biases, the router and its expert bias) is replicated and taken from tp rank 0;
* experts: ``local_experts.{j}`` (or Transformer Engine's ``weight{j}``) of ep rank ``e``
  is global expert ``e * E/ep + j``, stacked ``[E, ...]``;
* multi-token prediction (the last stage's ``mtp.layers.<k>.*``): the depth's
  ``eh_proj`` is column-parallel, its layer (``mtp_model_layer``, saved as
  ``transformer_layer``) merges as a decoder layer does, one key per depth.

Every rank's file is read into memory at once: a converter for checkpoints that fit.
"""

from __future__ import annotations

import os
import re

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron import legacy_optimizer
from megalite.checkpoint.megatron.files import LEGACY_FILE, MegatronCheckpoint, load_pickled
from megalite.checkpoint.megatron.mapping import LAYERS, MTP_LAYER, PER_LAYER, mtp_key

DISTRIBUTED_FILE = "distrib_optim.pt"   # the distributed optimizer's state beside it
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
EXPERT_KEY = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|"
                        r"(linear_fc[12])\.weight(\d+))$")
MLA_COLUMN = tuple(f"self_attention.{proj}.{p}" for proj in (
    "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj") for p in ("weight", "bias"))
# the latent down projections: column-parallel in Megatron-Core's local spec, whole on every
# rank in Transformer Engine's (--transformer-impl transformer_engine)
MLA_DOWN = tuple(f"self_attention.{proj}.{p}" for proj in (
    "linear_q_down_proj", "linear_kv_down_proj") for p in ("weight", "bias"))
COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "embedding.word_embeddings.weight",
          "output_layer.weight", "linear_fc1", "mlp.shared_experts.linear_fc1.weight",
          "mlp.shared_experts.linear_fc1.bias", "eh_proj.weight", *MLA_COLUMN)
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "linear_fc2",
       "mlp.shared_experts.linear_fc2.weight")
GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "linear_fc1",
         "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias")


def _rank_files(directory: str) -> dict[tuple[int, int, int], str]:
    """(tp, pp, ep) rank -> its model_optim_rng.pt. Megatron names a rank
    ``mp_rank_TT``, then ``_PPP`` when pipeline-parallel, then ``_EEE`` when
    expert-parallel: with one 3-digit group, the saved args tell which it is."""
    found = {}
    for name in os.listdir(directory):
        m = RANK_DIR.match(name)
        path = os.path.join(directory, name, LEGACY_FILE)
        if m and os.path.exists(path):
            found[(int(m[1]),) + tuple(int(g) for g in m.groups()[1:] if g is not None)] = path
    if not found:
        raise CheckpointError(f"{directory}: no mp_rank_*/{LEGACY_FILE} files")
    if all(len(r) == 3 for r in found):
        return found
    if any(len(r) == 3 for r in found):
        raise CheckpointError(f"{directory}: rank directories of two naming schemes")
    first = found[min(found)]
    if all(len(r) == 1 for r in found):
        return {(t, 0, 0): p for (t,), p in found.items()}
    pipelined = getattr(_load(first).get("args"), "pipeline_model_parallel_size", 1) > 1
    return {((t, g, 0) if pipelined else (t, 0, g)): p for (t, g), p in found.items()}


def _load(path: str, chained: bool = False) -> dict | list:
    """The pickled dict at ``path`` (``chained``: or a list, as a chained distributed
    optimizer's ``distrib_optim.pt`` holds one dict per optimizer, None for one whose
    state another rank saved)."""
    try:
        state = load_pickled(path)
    except Exception as exc:  # truncated or foreign: one line, not an unpickling traceback
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from None
    if chained and isinstance(state, list) and all(isinstance(s, (dict, type(None)))
                                                   for s in state):
        return state
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a Megatron "
                              f"checkpoint dict")
    return state


def _merge_tp(name: str, shards: list[torch.Tensor], gated: bool,
              column: tuple[str, ...] = COLUMN) -> torch.Tensor:
    """One tensor from its tp shards (``name``: the key, or an expert's ``linear_fc1/2``;
    ``column``: the column-parallel names)."""
    if len(shards) == 1 or name not in column + ROW:
        return shards[0]
    if name in ROW:
        return torch.cat(shards, dim=1)
    if gated and name in GATED:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=0)


def _chunks(state: dict) -> list[dict]:
    """The model chunks of one rank's file (one, or one per virtual stage)."""
    if "model" in state:
        return [state["model"]]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not keys:
        raise CheckpointError("a legacy Megatron file without a model state dict")
    return [state[k] for k in keys]


def read_legacy(ckpt: MegatronCheckpoint, load_optim: bool = True
                ) -> tuple[dict, dict, dict]:
    """(common state, global tensors by torch_dist sharded key, their chunks) of a legacy
    checkpoint; layer-stacked keys ``[L, ...]`` with chunks naming the layers held. With
    ``load_optim`` the optimizer state too (:mod:`.legacy_optimizer`), as
    ``optimizer.state.<state>.<key>`` tensors, or why not as the common state's
    ``optimizer_unreadable``."""
    files = _rank_files(ckpt.directory)
    tps, pps, eps = (1 + max(r[i] for r in files) for i in range(3))
    missing = [(t, p, e) for t in range(tps) for p in range(pps) for e in range(eps)
               if (t, p, e) not in files]
    if missing:
        raise CheckpointError(f"{ckpt.directory}: rank files missing for (tp, pp, ep) "
                              f"{missing[:3]}")
    states = {r: _load(path) for r, path in files.items()}
    common = {k: v for k, v in states[(0, 0, 0)].items()
              if k not in ("rng_state", "optimizer", "opt_param_scheduler")
              and not re.fullmatch(r"model\d*", k)}
    common["optimizer_saved"] = "optimizer" in states[(0, 0, 0)]
    if "args" not in common:
        raise CheckpointError(f"{ckpt.directory}: the rank files hold no Megatron args")
    args = common["args"]
    local = getattr(args, "transformer_impl", "transformer_engine") == "local"
    merge = _Merge(tps, pps, eps, {r: _chunks(s) for r, s in states.items()},
                   bool(getattr(args, "swiglu", False)), COLUMN + MLA_DOWN if local else COLUMN)
    tensors, chunks = _stack_layers(merge(merge.ranks), merge.num_layers)
    if common["optimizer_saved"] and load_optim:   # merged as the weights are
        beside = {r: os.path.join(os.path.dirname(path), DISTRIBUTED_FILE)
                  for r, path in files.items()}
        distributed = {r: _load(path, chained=True) for r, path in beside.items()
                       if os.path.exists(path)}
        try:
            by_state, common["optimizer"] = legacy_optimizer.rank_states(
                {r: s["optimizer"] for r, s in states.items()}, merge.ranks, args, distributed)
        except legacy_optimizer.Unplaced as why:
            common["optimizer_unreadable"] = str(why)
        else:
            for name, ranks in by_state.items():
                merged, _ = _stack_layers(merge(ranks), merge.num_layers)
                tensors.update({f"optimizer.state.{name}.{k}": t for k, t in merged.items()})
    return common, tensors, chunks


class _Merge:
    """The merge of per-rank tensors named as a model's state dict (the weights, or one
    optimizer state per parameter) into global tensors by sharded key (module
    docstring). ``ranks``: (tp, pp, ep) rank -> its model chunks' dicts."""

    def __init__(self, tps: int, pps: int, eps: int, ranks: dict, gated: bool, column):
        self.tps, self.pps, self.eps, self.ranks = tps, pps, eps, ranks
        self.gated, self.column = gated, column
        self.num_chunks = len(ranks[(0, 0, 0)])
        # global layer number of (stage, chunk, local layer): chunk-major, then stage
        self.offsets, start = {}, 0
        for v in range(self.num_chunks):
            for p in range(pps):
                held = {int(m[1]) for k in ranks[(0, p, 0)][v] if (m := PER_LAYER.match(k))}
                self.offsets[(p, v)] = start
                start += len(held)
        self.num_layers = start

    def __call__(self, ranks: dict) -> dict[str, torch.Tensor]:
        """``ranks`` (as :attr:`ranks`, any subset of each chunk's keys) merged: global
        key (layers not yet stacked) -> tensor."""
        merged: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        for p in range(self.pps):
            for v in range(self.num_chunks):
                names = [k for k in ranks[(0, p, 0)][v] if "_extra_state" not in k]
                for e in range(self.eps):
                    per_tp = [ranks[(t, p, e)][v] for t in range(self.tps)]
                    for key in names:
                        prefix, suffix = _split(key, self.offsets[(p, v)])
                        x = EXPERT_KEY.match(suffix)
                        if x is None and e > 0:
                            continue   # non-expert tensors: ep rank 0's
                        shards = [s[key] for s in per_tp]
                        if x is None:
                            merged[prefix + suffix] = _merge_tp(suffix, shards, self.gated,
                                                                self.column)
                            continue
                        j, which = (int(x[1]), x[2]) if x[1] is not None else (int(x[4]), x[3])
                        experts.setdefault((prefix, which), {})[(e, j)] = \
                            _merge_tp(which, shards, self.gated)
        for (prefix, which), by_rank in experts.items():
            per_rank = 1 + max(j for _, j in by_rank)
            stacked = [by_rank[(e, j)] for e in range(self.eps) for j in range(per_rank)]
            merged[f"{prefix}mlp.experts.experts.{which}.weight"] = torch.stack(stacked)
        return merged


def _split(key: str, offset: int) -> tuple[str, str]:
    """(global prefix, suffix) of a rank file's key: ``decoder.layers.<i>.<s>`` of a chunk
    whose first layer is global ``offset`` -> (``decoder.layers.<offset + i>.``, ``s``); a
    prediction depth's ``mtp.layers.<k>.mtp_model_layer.<s>`` (older files:
    ``transformer_layer``) -> (``mtp.layers.<k>.transformer_layer.``, ``s``) and its
    own ``mtp.layers.<k>.<s>`` -> (``mtp.layers.<k>.``, ``s``); other keys -> ("", key)."""
    m = PER_LAYER.match(key)
    if m:
        return f"decoder.layers.{offset + int(m[1])}.", m[2]
    depth = mtp_key(key)
    if depth is None:
        return "", key
    k, suffix, inner = depth
    return (MTP_LAYER.format(k) if inner else f"mtp.layers.{k}."), suffix


def _stack_layers(merged: dict[str, torch.Tensor], num_layers: int) -> tuple[dict, dict]:
    """Per-layer keys -> ``decoder.layers.<suffix>`` ``[L, ...]`` (zeros where a layer lacks
    the tensor) with chunks naming the layers that hold it; other keys as they are."""
    tensors, chunks, by_suffix = {}, {}, {}
    for key, t in merged.items():
        m = PER_LAYER.match(key)
        if m is None:
            tensors[key] = t
            chunks[key] = [((0,) * t.dim(), tuple(t.shape))]
        else:
            by_suffix.setdefault(m[2], {})[int(m[1])] = t
    for suffix, layers in by_suffix.items():
        first = next(iter(layers.values()))
        stacked = first.new_zeros(num_layers, *first.shape)
        for i, t in layers.items():
            stacked[i] = t
        key = LAYERS + suffix
        tensors[key] = stacked
        chunks[key] = [((i,) + (0,) * first.dim(), (1, *first.shape)) for i in sorted(layers)]
    return tensors, chunks
