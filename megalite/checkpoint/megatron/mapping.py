"""Megatron-Core's sharded tensor keys <-> megalite's full state dict, and Megatron's
``args`` -> megalite's ``ModelConfig``.

Megatron-Core (``torch_dist``) stores each layer's tensors stacked under one key with a
leading layer dimension, ``decoder.layers.<suffix>`` ``[L, ...]`` (``[L, E, ...]`` for
experts), every tensor with its global (tp = 1) shape; megalite's full state dict has
``decoder.layers.<i>.<suffix>``. Where the two differ:

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
==========================================  ==============================================

Embedding and output rows beyond the vocabulary (Megatron pads it to a multiple of
``make_vocab_size_divisible_by x tp``) are dropped on import and zero on export; a tied
output layer is not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYERS = "decoder.layers."
OURS_LAYER = "decoder.layers.{}."
WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
GLOBALS = (WORD, POSITION, "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
           OUTPUT)
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")

PLAIN, QKV, EXPERT = "plain", "qkv", "expert"


@dataclass(frozen=True)
class Rule:
    megatron: str   # suffix under decoder.layers.
    ours: str       # suffix under decoder.layers.<i>.
    kind: str = PLAIN


# The first rule for a megalite name is the one an export writes (the names the
# Transformer Engine and local layer specs both load); the others are read too.
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
    Rule("mlp.experts.experts.linear_fc1.weight", "mlp.experts.fc1", EXPERT),
    Rule("mlp.experts.experts.linear_fc2.weight", "mlp.experts.fc2", EXPERT),
)
BY_MEGATRON = {r.megatron: r for r in LAYER_RULES}


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


def unknown_keys(keys) -> list[str]:
    """Model keys of a Megatron checkpoint that no rule maps."""
    return sorted(k for k in keys if is_model_key(k) and k not in GLOBALS and not (
        k.startswith(LAYERS) and k[len(LAYERS):] in BY_MEGATRON))


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
        if not key.startswith(LAYERS) or key[len(LAYERS):] not in BY_MEGATRON:
            continue
        rule = BY_MEGATRON[key[len(LAYERS):]]
        for i in layers_held(chunks[key]):
            x = t[i]
            if rule.kind == QKV:
                x = qkv_from_megatron(x, c.num_attention_heads, c.num_query_groups,
                                      c.kv_channels)
            elif rule.kind == EXPERT:
                x = x.transpose(-1, -2)
            out[OURS_LAYER.format(i) + rule.ours] = x.contiguous()
    return {k: v.to(torch.float32) for k, v in out.items()}


def to_megatron(full: dict[str, torch.Tensor], model_cfg, padded_vocab: int
                ) -> dict[str, torch.Tensor]:
    """megalite's full state dict -> Megatron-Core's stacked sharded keys (the inverse of
    :func:`to_megalite`; vocabulary rows padded with zeros to ``padded_vocab``)."""
    c = model_cfg
    out = {}
    for key in GLOBALS:
        if key in full:
            t = full[key]
            if key in (WORD, OUTPUT):
                t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
            out[key] = t
    written = set()
    for rule in LAYER_RULES:
        if rule.ours in written:
            continue
        per_layer = [full.get(OURS_LAYER.format(i) + rule.ours) for i in range(c.num_layers)]
        if any(x is None for x in per_layer):
            continue
        written.add(rule.ours)
        if rule.kind == QKV:
            per_layer = [qkv_to_megatron(x, c.num_attention_heads, c.num_query_groups,
                                         c.kv_channels) for x in per_layer]
        elif rule.kind == EXPERT:
            per_layer = [x.transpose(-1, -2) for x in per_layer]
        out[LAYERS + rule.megatron] = torch.stack(per_layer).contiguous()
    return out
