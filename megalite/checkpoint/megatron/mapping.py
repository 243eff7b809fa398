"""Megatron-Core's sharded tensor keys <-> megalite's full state dict, and Megatron's
``args`` -> megalite's ``ModelConfig``.

Megatron-Core (``torch_dist``) stores each layer's tensors stacked under one key with a
leading layer dimension, ``decoder.layers.<suffix>`` ``[L, ...]`` (``[L, E, ...]`` for
experts), every tensor with its global (tp = 1) shape -- except when its layers differ
(``--moe-layer-freq`` other than 1: dense and MoE layers), where each layer has its own
keys ``decoder.layers.<i>.<suffix>`` (global ``i``, no layer dimension). megalite's full
state dict has ``decoder.layers.<i>.<suffix>``. Where the two differ:

==========================================  ==============================================
Megatron-Core (per layer)                   megalite
==========================================  ==============================================
``self_attention.linear_qkv.weight``        ``self_attention.linear_qkv.weight``
``[ng * (nh/ng + 2) * d, h]``: per query    ``[(nh + 2 ng) d, h]``: ``[Q; K; V]``, each
group its q heads, then its k, then its v   head-major (the head of q row block j of
                                            group g is ``g * nh/ng + j``)
``self_attention.linear_qkv.layer_norm_*``  ``input_layernorm.*`` (Transformer Engine
(or ``input_layernorm.*``)                  folds the norm into the linear; we don't)
``mlp.linear_fc1.layer_norm_*``             ``pre_mlp_layernorm.*``
(or ``pre_mlp_layernorm.*``)
``mlp.linear_fc1.weight`` ``[2f, h]``       the same: ``[gate; up]`` under SwiGLU
``mlp.experts.experts.linear_fc1.weight``   ``mlp.experts.fc1`` ``[E, h, 2f]``
``[E, 2f, h]``                              (transposed: experts multiply ``x @ w``)
``mlp.experts.experts.linear_fc2.weight``   ``mlp.experts.fc2`` ``[E, f, h]``
``[E, h, f]``
``mlp.shared_experts.linear_fc{1,2}.*``     ``mlp.shared_experts.fc{1,2}.*``
``self_attention.linear_q_up_proj.``        ``self_attention.q_layernorm.*`` (multi-latent
``layer_norm_*`` (Transformer Engine)       attention's query latent norm; the local spec
                                            writes ``q_layernorm.*``, as we do)
``self_attention.linear_kv_up_proj.``       ``self_attention.kv_layernorm.*``
``layer_norm_*`` (Transformer Engine)
``mtp.layers.<k>.transformer_layer.<s>``    ``mtp.layers.<k>.transformer_layer.<s'>``: a
(legacy files: ``mtp_model_layer.<s>``)     prediction depth's layer, one key per depth,
                                            ``<s>`` -> ``<s'>`` as a decoder layer's
==========================================  ==============================================

Which norm names an export writes depends on the layer spec Megatron will build
(``--transformer-impl``, :func:`export_suffix`): Transformer Engine's fuses a norm into the
linear after it where that linear is a ``LayerNorm*Linear`` (the QKV projection, a dense
MLP's fc1, multi-latent attention's up projections) and keeps ``pre_mlp_layernorm`` of an
MoE layer; the local spec saves standard attention's norms under the fused names (MoE
layers too) and multi-latent attention's under their own.

Everything else has the same name on both sides: QK norm (``self_attention.q_layernorm``,
``k_layernorm``), multi-latent attention's projections (``linear_q_proj`` or
``linear_q_down_proj`` / ``linear_q_up_proj``, ``linear_kv_down_proj`` ``[kv_lora_rank +
qk_pos_emb_head_dim, h]``, ``linear_kv_up_proj`` ``[nh * (qk_head_dim + v_head_dim),
kv_lora_rank]``, per head its key part then its value part), the router's ``weight`` and its
``expert_bias`` ``[E]`` (fp32, aux-loss-free balancing), a prediction depth's ``enorm``,
``hnorm``, ``eh_proj`` ``[h, 2h]`` and ``final_layernorm``.

Embedding and output rows beyond the vocabulary (Megatron pads it to a multiple of
``make_vocab_size_divisible_by x tp``) are dropped on import and zero on export; a tied
output layer is not stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

LAYERS = "decoder.layers."
PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
OURS_LAYER = "decoder.layers.{}."
WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
GLOBALS = (WORD, POSITION, "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
           OUTPUT)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
# a prediction depth's tensors: its own, and its transformer layer's (Megatron-Core's
# sharded keys call the layer transformer_layer, its module and legacy files mtp_model_layer)
MTP_KEY = re.compile(r"mtp\.layers\.(\d+)\.(?:(?:transformer_layer|mtp_model_layer)\.(.+)|(.+))$")
MTP_OWN = tuple(f"{n}.{p}" for n in ("enorm", "hnorm", "final_layernorm")
                for p in ("weight", "bias")) + ("eh_proj.weight",)
MTP_LAYER = "mtp.layers.{}.transformer_layer."
TE, LOCAL = "transformer_engine", "local"   # --transformer-impl

PLAIN, QKV, EXPERT = "plain", "qkv", "expert"


@dataclass(frozen=True)
class Rule:
    megatron: str   # suffix under decoder.layers.
    ours: str       # suffix under decoder.layers.<i>.
    kind: str = PLAIN


# Every rule is read; an export writes the one export_suffix() picks for the layer spec.
LAYER_RULES = (
    Rule("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    Rule("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    Rule("input_layernorm.weight", "input_layernorm.weight"),
    Rule("input_layernorm.bias", "input_layernorm.bias"),
    Rule("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight", QKV),
    Rule("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias", QKV),
    Rule("self_attention.linear_proj.weight", "self_attention.linear_proj.weight"),
    Rule("self_attention.linear_proj.bias", "self_attention.linear_proj.bias"),
    Rule("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    Rule("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    Rule("pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight"),
    Rule("pre_mlp_layernorm.bias", "pre_mlp_layernorm.bias"),
    Rule("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
    Rule("mlp.linear_fc1.bias", "mlp.linear_fc1.bias"),
    Rule("mlp.linear_fc2.weight", "mlp.linear_fc2.weight"),
    Rule("mlp.linear_fc2.bias", "mlp.linear_fc2.bias"),
    Rule("mlp.router.weight", "mlp.router.weight"),
    Rule("mlp.router.expert_bias", "mlp.router.expert_bias"),
    Rule("mlp.experts.experts.linear_fc1.weight", "mlp.experts.fc1", EXPERT),
    Rule("mlp.experts.experts.linear_fc2.weight", "mlp.experts.fc2", EXPERT),
    *(Rule(f"mlp.shared_experts.linear_{fc}.{p}", f"mlp.shared_experts.{fc}.{p}")
      for fc in ("fc1", "fc2") for p in ("weight", "bias")),
    *(Rule(f"self_attention.{norm}.{p}", f"self_attention.{norm}.{p}")
      for norm in ("q_layernorm", "k_layernorm", "kv_layernorm") for p in ("weight", "bias")),
    *(Rule(f"self_attention.{proj}.{p}", f"self_attention.{proj}.{p}")
      for proj in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                   "linear_kv_down_proj", "linear_kv_up_proj") for p in ("weight", "bias")),
    # Transformer Engine's spec folds multi-latent attention's latent norms into the up
    # projections
    *(Rule(f"self_attention.linear_{x}_up_proj.layer_norm_{p}", f"self_attention.{x}_layernorm.{p}")
      for x in ("q", "kv") for p in ("weight", "bias")),
)
BY_MEGATRON = {r.megatron: r for r in LAYER_RULES}
BY_OURS = {}
for _rule in LAYER_RULES:
    BY_OURS.setdefault(_rule.ours, _rule)


def export_suffix(ours: str, *, mla: bool, moe: bool, impl: str = TE) -> str:
    """The Megatron-Core suffix an export writes for our layer suffix ``ours`` in a layer
    with multi-latent attention (``mla``) or an MoE MLP (``moe``), as the layer spec of
    ``--transformer-impl`` ``impl`` names it (the norm rows of the module docstring)."""
    norm, _, p = ours.rpartition(".")
    if norm == "input_layernorm":
        return ours if mla else f"self_attention.linear_qkv.layer_norm_{p}"
    if norm == "pre_mlp_layernorm":
        fused = not moe if impl == TE else not mla
        return f"mlp.linear_fc1.layer_norm_{p}" if fused else ours
    if mla and impl == TE and norm in ("self_attention.q_layernorm",
                                       "self_attention.kv_layernorm"):
        x = norm.split(".")[1].removesuffix("_layernorm")
        return f"self_attention.linear_{x}_up_proj.layer_norm_{p}"
    return BY_OURS[ours].megatron


# -- q/k/v ------------------------------------------------------------------------------------
def qkv_from_megatron(w: torch.Tensor, heads: int, groups: int, d: int) -> torch.Tensor:
    """``[ng * (nh/ng + 2) * d, ...]`` grouped q|k|v -> ``[(nh + 2 ng) * d, ...]`` Q;K;V."""
    rest = w.shape[1:]
    w = w.reshape(groups, heads // groups + 2, d, *rest)
    return torch.cat([w[:, :-2].reshape(heads * d, *rest), w[:, -2].reshape(groups * d, *rest),
                      w[:, -1].reshape(groups * d, *rest)])


def qkv_to_megatron(w: torch.Tensor, heads: int, groups: int, d: int) -> torch.Tensor:
    """The inverse of :func:`qkv_from_megatron`."""
    rest = w.shape[1:]
    q, k, v = w.split([heads * d, groups * d, groups * d])
    parts = [q.reshape(groups, heads // groups, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


# -- tensors ----------------------------------------------------------------------------------
def is_model_key(key: str) -> bool:
    return key.startswith(MODEL_PREFIXES) and "_extra_state" not in key


def layers_held(chunks) -> list[int]:
    """Layer indices a stacked key's chunks cover (dimension 0 of each chunk)."""
    held = set()
    for offsets, sizes in chunks:
        held.update(range(offsets[0], offsets[0] + sizes[0]))
    return sorted(held)


def layer_key(key: str) -> tuple[int | None, str] | None:
    """(layer, suffix) of a layer key: ``decoder.layers.<i>.<suffix>`` -> ``(i, suffix)``,
    a stacked ``decoder.layers.<suffix>`` -> ``(None, suffix)``; None for other keys."""
    m = PER_LAYER.match(key)
    if m:
        return int(m[1]), m[2]
    return (None, key[len(LAYERS):]) if key.startswith(LAYERS) else None


def per_layer_keys(model_cfg) -> bool:
    """Whether Megatron-Core keys this model's layers one by one (its layers differ:
    ``--moe-layer-freq`` other than 1) rather than stacked."""
    return bool(model_cfg.num_experts) and model_cfg.moe_layer_freq != 1


def mtp_key(key: str) -> tuple[int, str, bool] | None:
    """(depth index, suffix, whether the suffix is its transformer layer's) of a prediction
    depth's key ``mtp.layers.<k>.<suffix>``; None for other keys."""
    m = MTP_KEY.match(key)
    if m is None:
        return None
    return (int(m[1]), m[2], True) if m[2] is not None else (int(m[1]), m[3], False)


def unknown_keys(keys) -> list[str]:
    """Model keys of a Megatron checkpoint that no rule maps."""
    def known(k):
        parsed, depth = layer_key(k), mtp_key(k)
        if depth is not None:
            return depth[1] in (BY_MEGATRON if depth[2] else MTP_OWN)
        return k in GLOBALS or (parsed is not None and parsed[1] in BY_MEGATRON)

    return sorted(k for k in keys if is_model_key(k) and not known(k))


def unmapped(full_keys) -> list[str]:
    """megalite state dict keys that no rule writes to Megatron (a feature whose tensors
    Megatron-Core names otherwise or lacks)."""
    def mapped(k):
        if (m := PER_LAYER.match(k)) is not None:
            return m[2] in BY_OURS
        if (depth := mtp_key(k)) is not None:
            return depth[1] in (BY_OURS if depth[2] else MTP_OWN)
        return k in GLOBALS

    return sorted(k for k in full_keys if not mapped(k))


def _relayout(rule: Rule, x: torch.Tensor, c, *, to_ours: bool) -> torch.Tensor:
    """One layer's tensor, Megatron's layout -> ours (``to_ours``) or back."""
    if rule.kind == QKV:
        regroup = qkv_from_megatron if to_ours else qkv_to_megatron
        x = regroup(x, c.num_attention_heads, c.num_query_groups, c.kv_channels)
    elif rule.kind == EXPERT:
        x = x.transpose(-1, -2)
    return x.contiguous()


def to_megalite(tensors: dict[str, torch.Tensor], chunks: dict[str, list], model_cfg
                ) -> dict[str, torch.Tensor]:
    """Megatron's full tensors (by sharded key; ``chunks`` tells which layers each stacked
    key holds) -> megalite's full state dict for ``model_cfg`` (fp32)."""
    c = model_cfg
    vocab = c.vocab_size
    out = {}
    for key in GLOBALS:
        if key not in tensors or (key == OUTPUT and not c.untie_embeddings_and_output_weights):
            continue
        t = tensors[key]
        out[key] = t[:vocab] if key in (WORD, OUTPUT) else t
    for key, t in tensors.items():
        depth = mtp_key(key)
        if depth is not None:
            k, suffix, inner = depth
            if inner and suffix in BY_MEGATRON:
                rule = BY_MEGATRON[suffix]
                out[MTP_LAYER.format(k) + rule.ours] = _relayout(rule, t, c, to_ours=True)
            elif not inner and suffix in MTP_OWN:
                out[key] = t
            continue
        parsed = layer_key(key)
        if parsed is None or parsed[1] not in BY_MEGATRON:
            continue
        layer, suffix = parsed
        rule = BY_MEGATRON[suffix]
        held = [(layer, t)] if layer is not None else \
            [(i, t[i]) for i in layers_held(chunks[key])]
        for i, x in held:
            out[OURS_LAYER.format(i) + rule.ours] = _relayout(rule, x, c, to_ours=True)
    return {k: v.to(torch.float32) for k, v in out.items()}


def _layer_out(layer: dict[str, torch.Tensor], c, impl: str) -> dict[str, torch.Tensor]:
    """One layer's tensors (by our suffix) -> by the suffix ``impl``'s spec saves."""
    moe = "mlp.router.weight" in layer
    return {export_suffix(ours, mla=c.multi_latent_attention, moe=moe, impl=impl):
            _relayout(BY_OURS[ours], x, c, to_ours=False) for ours, x in layer.items()}


def to_megatron(full: dict[str, torch.Tensor], model_cfg, padded_vocab: int,
                impl: str = TE) -> dict[str, torch.Tensor]:
    """megalite's full state dict -> Megatron-Core's sharded keys, stacked or per layer
    as :func:`per_layer_keys` says, named for the layer spec of ``--transformer-impl``
    ``impl`` (the inverse of :func:`to_megalite`; vocabulary rows padded with zeros to
    ``padded_vocab``). Raises ``ValueError`` for a tensor no rule writes
    (:func:`unmapped`)."""
    c = model_cfg
    nameless = unmapped(full)
    if nameless:
        raise ValueError(f"no Megatron-Core name for {', '.join(nameless[:3])}")
    out = {}
    for key in GLOBALS:
        if key in full:
            t = full[key]
            if key in (WORD, OUTPUT):
                t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
            out[key] = t
    layers = [{} for _ in range(c.num_layers)]
    depths: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in full.items():
        if (m := PER_LAYER.match(key)) is not None:
            layers[int(m[1])][m[2]] = t
        elif (depth := mtp_key(key)) is not None:
            k, suffix, inner = depth
            if inner:
                depths.setdefault(k, {})[suffix] = t
            else:
                out[key] = t
    layers = [_layer_out(layer, c, impl) for layer in layers]
    if per_layer_keys(c):
        out.update({f"{LAYERS}{i}.{name}": x for i, layer in enumerate(layers)
                    for name, x in layer.items()})
    else:   # every layer has the same tensors
        out.update({LAYERS + name: torch.stack([layer[name] for layer in layers])
                    for name in layers[0]})
    for k, layer in depths.items():
        out.update({MTP_LAYER.format(k) + name: x
                    for name, x in _layer_out(layer, c, impl).items()})
    return out
