"""Parameter names and layouts: megalite <-> Hugging Face ``transformers``.

Both directions work on *full* (unsharded) state dicts, as from
``GPTModel.full_state_dict()``; ``GPTModel.load_full_state_dict`` shards them.

Layout notes:

* Fused tensors. Our ``linear_qkv`` is ``[Q; K; V]`` stacked along the output dim
  (``nh*d``, ``ng*d``, ``ng*d`` rows) and SwiGLU's ``linear_fc1`` is ``[gate; up]``; the
  TP sharding splits each part separately (``layers.sharding``), so the full tensors here
  are plain concatenations of Hugging Face's q/k/v and gate/up projections.
* RoPE. We rotate in Hugging Face's rotate-half layout natively, so Llama q/k weights
  need no permutation (Meta's original checkpoints use the interleaved layout and need
  HF's usual permutation before coming here).
* GPT-2 uses ``Conv1D`` whose weights are ``[in, out]``: transposed on the way.
* GPT-2's activation: megalite uses exact GeLU (Megatron's default); original GPT-2
  checkpoints use the tanh approximation (``gelu_new``), so logits of converted OpenAI
  weights differ slightly (~1e-3) unless the model uses the same approximation.
* Llama biases: HF's ``attention_bias`` covers q, k, v and o together; megalite's
  ``--add-qkv-bias`` without linear biases has no o bias, so HF's would stay unset.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FAMILIES = ("gpt2", "llama")


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _layer_rules(family: str) -> list[tuple[str, str, Callable, Callable]]:
    """(our suffix, HF suffix, ours->HF, HF->ours) for the unfused per-layer tensors."""
    if family == "gpt2":
        return [
            ("input_layernorm.weight", "ln_1.weight", _same, _same),
            ("input_layernorm.bias", "ln_1.bias", _same, _same),
            ("self_attention.linear_qkv.weight", "attn.c_attn.weight", _t, _t),
            ("self_attention.linear_qkv.bias", "attn.c_attn.bias", _same, _same),
            ("self_attention.linear_proj.weight", "attn.c_proj.weight", _t, _t),
            ("self_attention.linear_proj.bias", "attn.c_proj.bias", _same, _same),
            ("pre_mlp_layernorm.weight", "ln_2.weight", _same, _same),
            ("pre_mlp_layernorm.bias", "ln_2.bias", _same, _same),
            ("mlp.linear_fc1.weight", "mlp.c_fc.weight", _t, _t),
            ("mlp.linear_fc1.bias", "mlp.c_fc.bias", _same, _same),
            ("mlp.linear_fc2.weight", "mlp.c_proj.weight", _t, _t),
            ("mlp.linear_fc2.bias", "mlp.c_proj.bias", _same, _same),
        ]
    return [
        ("input_layernorm.weight", "input_layernorm.weight", _same, _same),
        ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", _same, _same),
        ("self_attention.linear_proj.bias", "self_attn.o_proj.bias", _same, _same),
        ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", _same, _same),
        ("mlp.linear_fc2.weight", "mlp.down_proj.weight", _same, _same),
        ("mlp.linear_fc2.bias", "mlp.down_proj.bias", _same, _same),
    ]


def _llama_fused(cfg) -> list[tuple[str, list[str], list[int]]]:
    """(our suffix, HF suffixes, part sizes) of the tensors fused in megalite."""
    nh, ng, d, ffn = (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                      cfg.ffn_hidden_size)
    qkv = [nh * d, ng * d, ng * d]
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    return [
        ("self_attention.linear_qkv.weight", [n + ".weight" for n in names], qkv),
        ("self_attention.linear_qkv.bias", [n + ".bias" for n in names], qkv),
        ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [ffn, ffn]),
        ("mlp.linear_fc1.bias", ["mlp.gate_proj.bias", "mlp.up_proj.bias"], [ffn, ffn]),
    ]


def _globals(family: str, tied: bool) -> list[tuple[str, str]]:
    if family == "gpt2":
        rules = [("embedding.word_embeddings.weight", "transformer.wte.weight"),
                 ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
                 ("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
                 ("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
    else:
        rules = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                 ("decoder.final_layernorm.weight", "model.norm.weight")]
    if not tied:
        rules.append(("output_layer.weight", "lm_head.weight"))
    return rules


def _prefixes(family: str, i: int) -> tuple[str, str]:
    hf = f"transformer.h.{i}." if family == "gpt2" else f"model.layers.{i}."
    return f"decoder.layers.{i}.", hf


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {FAMILIES}")


def to_hf_state_dict(state: dict[str, torch.Tensor], model_cfg, family: str
                     ) -> dict[str, torch.Tensor]:
    """Our full state dict -> a ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` state dict."""
    _check_family(family)
    tied = not model_cfg.untie_embeddings_and_output_weights
    out = {hf: state[ours] for ours, hf in _globals(family, tied) if ours in state}
    if tied:
        out["lm_head.weight"] = state["embedding.word_embeddings.weight"]
    for i in range(model_cfg.num_layers):
        ours_p, hf_p = _prefixes(family, i)
        for ours, hf, fwd, _ in _layer_rules(family):
            if ours_p + ours in state:
                out[hf_p + hf] = fwd(state[ours_p + ours])
        if family == "llama":
            for ours, hf_names, sizes in _llama_fused(model_cfg):
                if ours_p + ours in state:
                    for hf, part in zip(hf_names, state[ours_p + ours].split(sizes)):
                        out[hf_p + hf] = part.contiguous()
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], model_cfg, family: str
                       ) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` state dict -> our full state dict.

    Tensors our configuration does not use (e.g. biases under --disable-bias-linear) must
    be absent from ``hf_state``; missing tensors raise ``KeyError`` naming them.
    """
    _check_family(family)
    tied = not model_cfg.untie_embeddings_and_output_weights
    out = {ours: hf_state[hf] for ours, hf in _globals(family, tied) if hf in hf_state}
    for i in range(model_cfg.num_layers):
        ours_p, hf_p = _prefixes(family, i)
        for ours, hf, _, back in _layer_rules(family):
            if hf_p + hf in hf_state:
                out[ours_p + ours] = back(hf_state[hf_p + hf])
        if family == "llama":
            for ours, hf_names, _ in _llama_fused(model_cfg):
                present = [hf_p + n in hf_state for n in hf_names]
                if any(present):
                    missing = [hf_p + n for n, p in zip(hf_names, present) if not p]
                    if missing:
                        raise KeyError(f"incomplete fused tensor {ours}: missing {missing}")
                    out[ours_p + ours] = torch.cat([hf_state[hf_p + n] for n in hf_names])
    return out


def hf_config(model_cfg, family: str):
    """A ``transformers`` config equivalent to ``model_cfg`` (imported lazily)."""
    _check_family(family)
    c = model_cfg
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings,
                          n_embd=c.hidden_size, n_layer=c.num_layers,
                          n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                          activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, layer_norm_epsilon=c.norm_epsilon,
                          tie_word_embeddings=not c.untie_embeddings_and_output_weights)
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
                       num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
                       max_position_embeddings=max(c.max_position_embeddings, c.seq_length),
                       rms_norm_eps=c.norm_epsilon, attention_bias=c.add_qkv_bias or c.add_bias_linear,
                       mlp_bias=c.add_bias_linear,
                       rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
                       tie_word_embeddings=not c.untie_embeddings_and_output_weights)


def model_config_from_hf(hf_cfg) -> tuple[str, dict]:
    """(family, ``ModelConfig`` keyword arguments) for a ``transformers`` config.

    Raises ``ValueError`` for what megalite cannot represent (rope scaling, an o_proj
    bias without MLP biases, an unknown ``model_type``). GPT-2's tanh-approximated GeLU
    (``gelu_new``) becomes megalite's exact GeLU: logits then differ by ~1e-3.
    """
    kind = getattr(hf_cfg, "model_type", None)
    if kind == "gpt2":
        h = hf_cfg.n_embd
        return "gpt2", {
            "num_layers": hf_cfg.n_layer, "hidden_size": h, "num_attention_heads": hf_cfg.n_head,
            "ffn_hidden_size": hf_cfg.n_inner or 4 * h, "vocab_size": hf_cfg.vocab_size,
            "max_position_embeddings": hf_cfg.n_positions, "seq_length": hf_cfg.n_positions,
            "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
            "norm_epsilon": hf_cfg.layer_norm_epsilon, "add_bias_linear": True,
            "untie_embeddings_and_output_weights": not hf_cfg.tie_word_embeddings}
    if kind != "llama":
        raise ValueError(f"model_type {kind!r} is not supported; megalite converts "
                         f"{', '.join(FAMILIES)}")
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported")
    attention_bias, mlp_bias = hf_cfg.attention_bias, hf_cfg.mlp_bias
    if attention_bias and not mlp_bias:
        raise ValueError("attention_bias without mlp_bias (a bias on o_proj only) has no "
                         "megalite equivalent")
    heads = hf_cfg.num_attention_heads
    groups = hf_cfg.num_key_value_heads or heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    return "llama", {
        "num_layers": hf_cfg.num_hidden_layers, "hidden_size": hf_cfg.hidden_size,
        "num_attention_heads": heads, "group_query_attention": groups != heads,
        "num_query_groups": groups, "kv_channels": head_dim,
        "ffn_hidden_size": hf_cfg.intermediate_size, "vocab_size": hf_cfg.vocab_size,
        "max_position_embeddings": hf_cfg.max_position_embeddings,
        "seq_length": min(hf_cfg.max_position_embeddings, 4096),
        "position_embedding_type": "rope", "rotary_base": float(rope.get("rope_theta", 10000.0)),
        "normalization": "RMSNorm", "norm_epsilon": hf_cfg.rms_norm_eps, "swiglu": True,
        "add_bias_linear": bool(mlp_bias), "add_qkv_bias": bool(attention_bias),
        "untie_embeddings_and_output_weights": not hf_cfg.tie_word_embeddings}
