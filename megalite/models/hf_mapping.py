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
* Mixtral: Llama's embeddings, attention and norms, and per layer (all ``[E, ...]`` with
  every global expert, as ``GPTModel.full_state_dict()`` gives them):

  ========================  ==================================  ===========================
  megalite                  transformers (v5, in memory)        hub files (``w1/w2/w3``)
  ========================  ==================================  ===========================
  ``mlp.router.weight``     ``mlp.gate.weight`` ``[E, h]``      ``block_sparse_moe.gate``
  ``mlp.experts.fc1``       ``mlp.experts.gate_up_proj``        ``fc1[j] = [w1_j.T | w3_j.T]``
  ``[E, h, 2f]`` gate|up    ``[E, 2f, h]``, transposed
  ``mlp.experts.fc2``       ``mlp.experts.down_proj``           ``fc2[j] = w2_j.T``
  ``[E, f, h]``             ``[E, h, f]``, transposed
  ========================  ==================================  ===========================

  :func:`from_hf_state_dict` reads either naming; :func:`to_hf_state_dict` writes the
  in-memory one (``MixtralForCausalLM.load_state_dict``). The router matches Mixtral's
  with ``--moe-router-score-function softmax`` (top-k of the logits, softmax over the k:
  the same as softmax over all E, top-k, renormalize) and no top-k scaling factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FAMILIES = ("gpt2", "llama", "mixtral")


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
    """Our full state dict -> a ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
    ``MixtralForCausalLM`` state dict."""
    _check_family(family)
    if family == "mixtral":
        return _mixtral_to_hf(state, model_cfg)
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
    """A ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ``MixtralForCausalLM`` state dict
    -> our full state dict.

    Tensors our configuration does not use (e.g. biases under --disable-bias-linear) must
    be absent from ``hf_state``; missing tensors raise ``KeyError`` naming them.
    """
    _check_family(family)
    if family == "mixtral":
        return _mixtral_from_hf(hf_state, model_cfg)
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
    if family == "mixtral":
        return _mixtral_hf_config(c)
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
                       rms_norm_eps=c.norm_epsilon,
                       attention_bias=c.add_qkv_bias or c.add_bias_linear,
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
    if kind == "mixtral":
        return "mixtral", _mixtral_kwargs_from_hf(hf_cfg)
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


# -- Mixtral: Llama attention and norms, a sparse MoE block per layer ----------------------
def check_mixtral(model_cfg) -> None:
    """Raise ``ValueError`` unless ``model_cfg`` is a model ``MixtralForCausalLM`` can hold."""
    c = model_cfg
    problems = [
        (c.num_experts is None, "--num-experts is not set"),
        (c.moe_layer_freq != 1, f"--moe-layer-freq {c.moe_layer_freq} (Mixtral: every layer)"),
        (bool(c.moe_shared_expert_intermediate_size), "shared experts"),
        (c.moe_router_score_function != "softmax",
         f"--moe-router-score-function {c.moe_router_score_function}"),
        (c.moe_router_topk_scaling_factor not in (None, 1.0), "a top-k scaling factor"),
        (c.add_bias_linear or c.add_qkv_bias, "linear biases"),
        (c.normalization != "RMSNorm" or not c.swiglu or c.position_embedding_type != "rope",
         "not RMSNorm + SwiGLU + RoPE"),
    ]
    found = [text for bad, text in problems if bad]
    if found:
        raise ValueError(f"not a Mixtral model: {'; '.join(found)}")


def _moe_prefixes(i: int) -> tuple[str, str]:
    return f"decoder.layers.{i}.mlp.", f"model.layers.{i}."


def _mixtral_to_hf(state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    check_mixtral(model_cfg)
    out = to_hf_state_dict(state, model_cfg, "llama")  # embeddings, attention, norms
    for i in range(model_cfg.num_layers):
        ours, hf = _moe_prefixes(i)
        if ours + "router.weight" not in state:  # e.g. another pipeline stage's layer
            continue
        out[hf + "mlp.gate.weight"] = state[ours + "router.weight"]
        out[hf + "mlp.experts.gate_up_proj"] = state[ours + "experts.fc1"].transpose(1, 2)
        out[hf + "mlp.experts.down_proj"] = state[ours + "experts.fc2"].transpose(1, 2)
    return {k: v.contiguous() for k, v in out.items()}


def _mixtral_from_hf(hf_state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    check_mixtral(model_cfg)
    out = from_hf_state_dict(hf_state, model_cfg, "llama")
    for i in range(model_cfg.num_layers):
        ours, hf = _moe_prefixes(i)
        if hf + "mlp.gate.weight" in hf_state:  # transformers v5 in-memory names
            moe = hf + "mlp."
            out[ours + "router.weight"] = hf_state[moe + "gate.weight"]
            out[ours + "experts.fc1"] = hf_state[moe + "experts.gate_up_proj"].transpose(1, 2)
            out[ours + "experts.fc2"] = hf_state[moe + "experts.down_proj"].transpose(1, 2)
        elif hf + "block_sparse_moe.gate.weight" in hf_state:  # hub checkpoint files
            moe = hf + "block_sparse_moe."

            def w(j: int, name: str, moe=moe) -> torch.Tensor:
                return hf_state[f"{moe}experts.{j}.{name}.weight"]

            experts = range(model_cfg.num_experts)
            out[ours + "router.weight"] = hf_state[moe + "gate.weight"]
            out[ours + "experts.fc1"] = torch.stack(
                [torch.cat([w(j, "w1").t(), w(j, "w3").t()], dim=1) for j in experts])
            out[ours + "experts.fc2"] = torch.stack([w(j, "w2").t() for j in experts])
    return {k: v.contiguous() for k, v in out.items()}


def _mixtral_hf_config(c):
    from transformers import MixtralConfig

    check_mixtral(c)
    return MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.moe_ffn_hidden_size,
                         num_hidden_layers=c.num_layers,
                         num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
                         max_position_embeddings=max(c.max_position_embeddings, c.seq_length),
                         rms_norm_eps=c.norm_epsilon, sliding_window=None,
                         num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                         router_aux_loss_coef=c.moe_aux_loss_coeff,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
                         tie_word_embeddings=not c.untie_embeddings_and_output_weights)


def _mixtral_kwargs_from_hf(hf_cfg) -> dict:
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported")
    seq = min(hf_cfg.max_position_embeddings, 4096)
    if hf_cfg.sliding_window is not None and hf_cfg.sliding_window < seq:
        raise ValueError(f"sliding-window attention ({hf_cfg.sliding_window}) is not "
                         "supported")
    heads = hf_cfg.num_attention_heads
    groups = hf_cfg.num_key_value_heads or heads
    return {
        "num_layers": hf_cfg.num_hidden_layers, "hidden_size": hf_cfg.hidden_size,
        "num_attention_heads": heads, "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
        "ffn_hidden_size": hf_cfg.intermediate_size, "vocab_size": hf_cfg.vocab_size,
        "max_position_embeddings": hf_cfg.max_position_embeddings, "seq_length": seq,
        "position_embedding_type": "rope",
        "rotary_base": float(rope.get("rope_theta", 1000000.0)),
        "normalization": "RMSNorm", "norm_epsilon": hf_cfg.rms_norm_eps, "swiglu": True,
        "add_bias_linear": False, "untie_embeddings_and_output_weights":
            not hf_cfg.tie_word_embeddings,
        "num_experts": hf_cfg.num_local_experts, "moe_router_topk": hf_cfg.num_experts_per_tok,
        "moe_ffn_hidden_size": hf_cfg.intermediate_size,
        "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(hf_cfg.router_aux_loss_coef)}


def mixtral_to_hub_names(hf_state: dict[str, torch.Tensor], model_cfg
                         ) -> dict[str, torch.Tensor]:
    """transformers' in-memory Mixtral state dict (fused ``mlp.experts.gate_up_proj`` /
    ``down_proj``, ``mlp.gate``) -> the per-expert ``block_sparse_moe.experts.{j}.w1/w2/w3``
    names of hub checkpoint files, which ``save_pretrained`` writes."""
    out, f = {}, model_cfg.moe_ffn_hidden_size
    for name, tensor in hf_state.items():
        prefix, sep, rest = name.partition(".mlp.")
        if not sep:
            out[name] = tensor
        elif rest == "gate.weight":
            out[f"{prefix}.block_sparse_moe.gate.weight"] = tensor
        elif rest == "experts.gate_up_proj":
            for j, w in enumerate(tensor):            # [2f, h] = [w1; w3]
                out[f"{prefix}.block_sparse_moe.experts.{j}.w1.weight"] = w[:f].contiguous()
                out[f"{prefix}.block_sparse_moe.experts.{j}.w3.weight"] = w[f:].contiguous()
        elif rest == "experts.down_proj":
            for j, w in enumerate(tensor):            # [h, f]
                out[f"{prefix}.block_sparse_moe.experts.{j}.w2.weight"] = w.contiguous()
        else:
            out[name] = tensor
    return out
