"""Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied embeddings
(``LlamaForCausalLM``; tied embeddings and HF's ``attention_bias`` / ``mlp_bias`` too).

* Fused tensors. Our ``linear_qkv`` is ``[Q; K; V]`` stacked along the output dim
  (``nh*d``, ``ng*d``, ``ng*d`` rows) and SwiGLU's ``linear_fc1`` is ``[gate; up]``
  (``f``, ``f`` rows): plain concatenations of HF's q/k/v and gate/up projections.
* RoPE. We rotate in Hugging Face's rotate-half layout natively, so q/k weights need no
  permutation (Meta's original checkpoints use the interleaved layout and need HF's usual
  permutation before coming here).
* Biases: HF's ``attention_bias`` covers q, k, v and o together; megalite's
  ``--add-qkv-bias`` without linear biases has no o bias, so HF's would stay unset.
"""

from __future__ import annotations

from megalite.models.families.names import (
    NameTable,
    Rename,
    fused_weight_and_bias,
    weight_and_bias,
)
from megalite.models.families.spec import FamilySpec, attention_variant_problems

MAX_SEQ_LENGTH = 4096  # seq_length of a converted model whose context is longer
HF_LAYER_PREFIX = "model.layers.{}."


def rope_theta(hf_cfg, default: float) -> float:
    """RoPE base of a Llama-like HF config; ``ValueError`` for rope scaling."""
    rope = dict(getattr(hf_cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported")
    return float(rope.get("rope_theta", default))


class LlamaSpec(FamilySpec):
    name = "llama"
    hf_model_type = "llama"
    hf_architecture = "LlamaForCausalLM"
    defaults = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                "add_bias_linear": False, "untie_embeddings_and_output_weights": True}
    rope_theta_default = 10000.0  # transformers' default for the family's configs

    def backbone_problems(self, model_cfg) -> list[str]:
        """Embeddings, attention and norms: what Llama and the families built on it share."""
        c = model_cfg
        return [text for bad, text in [
            (c.position_embedding_type != "rope",
             f"position embeddings {c.position_embedding_type!r} (needs rope)"),
            (c.rotary_percent != 1.0, f"--rotary-percent {c.rotary_percent}"),
            (c.normalization != "RMSNorm", f"{c.normalization} (needs RMSNorm)"),
            (not c.swiglu, "no SwiGLU"),
        ] if bad] + attention_variant_problems(c)

    def problems(self, model_cfg) -> list[str]:
        moe = model_cfg.num_experts is not None
        return self.backbone_problems(model_cfg) + (["experts (--num-experts)"] if moe else [])

    def name_table(self, model_cfg) -> NameTable:
        c = model_cfg
        nh, ng, d, f = c.num_attention_heads, c.num_query_groups, c.kv_channels, c.ffn_hidden_size
        return NameTable(
            hf_layer_prefix=HF_LAYER_PREFIX,
            globals=(Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                     Rename("decoder.final_layernorm.weight", "model.norm.weight")),
            layer=(Rename("input_layernorm.weight", "input_layernorm.weight"),
                   *weight_and_bias("self_attention.linear_proj", "self_attn.o_proj"),
                   Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                   *weight_and_bias("mlp.linear_fc2", "mlp.down_proj")),
            fused=(*fused_weight_and_bias(
                       "self_attention.linear_qkv",
                       ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       (nh * d, ng * d, ng * d)),
                   *fused_weight_and_bias("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"),
                                          (f, f))),
            tied=not c.untie_embeddings_and_output_weights)

    # -- configs -------------------------------------------------------------------------
    def backbone_hf_kwargs(self, model_cfg) -> dict:
        """The HF config arguments Llama and the families built on it share."""
        c = model_cfg
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
                    max_position_embeddings=max(c.max_position_embeddings, c.seq_length),
                    rms_norm_eps=c.norm_epsilon,
                    rope_parameters={"rope_type": "default", "rope_theta": c.rotary_base},
                    tie_word_embeddings=not c.untie_embeddings_and_output_weights)

    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import LlamaConfig

        self.check(model_cfg)
        c = model_cfg
        hf_cfg = LlamaConfig(**self.backbone_hf_kwargs(c), intermediate_size=c.ffn_hidden_size,
                             attention_bias=c.add_qkv_bias or c.add_bias_linear,
                             mlp_bias=c.add_bias_linear)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def backbone_from_hf(self, hf_cfg) -> dict:
        """``ModelConfig`` kwargs of the shared part (:meth:`defaults` first, sizes after);
        ``ValueError`` for rope scaling."""
        heads = hf_cfg.num_attention_heads
        groups = hf_cfg.num_key_value_heads or heads
        return {**self.defaults,
                "num_layers": hf_cfg.num_hidden_layers, "hidden_size": hf_cfg.hidden_size,
                "num_attention_heads": heads, "group_query_attention": groups != heads,
                "num_query_groups": groups,
                "kv_channels": getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
                "ffn_hidden_size": hf_cfg.intermediate_size, "vocab_size": hf_cfg.vocab_size,
                "max_position_embeddings": hf_cfg.max_position_embeddings,
                "seq_length": min(hf_cfg.max_position_embeddings, MAX_SEQ_LENGTH),
                "rotary_base": rope_theta(hf_cfg, self.rope_theta_default),
                "norm_epsilon": hf_cfg.rms_norm_eps,
                "untie_embeddings_and_output_weights": not hf_cfg.tie_word_embeddings}

    def config_from_hf(self, hf_cfg) -> dict:
        """``ValueError`` for rope scaling and for an o_proj bias without MLP biases."""
        kwargs = self.backbone_from_hf(hf_cfg)
        attention_bias, mlp_bias = hf_cfg.attention_bias, hf_cfg.mlp_bias
        if attention_bias and not mlp_bias:
            raise ValueError("attention_bias without mlp_bias (a bias on o_proj only) has no "
                             "megalite equivalent")
        return {**kwargs, "add_bias_linear": bool(mlp_bias),
                "add_qkv_bias": bool(attention_bias)}


SPEC = LlamaSpec()
