"""GPT-2: learned absolute positions, LayerNorm, GeLU MLP, biases everywhere, tied
embeddings (``GPT2LMHeadModel``).

* ``transformers``' GPT-2 uses ``Conv1D`` layers whose weights are ``[in, out]``: they are
  transposed on the way, both ways. Its q/k/v are already fused (``c_attn``, ``[Q | K | V]``
  along the output dim), as our ``linear_qkv`` is.
* Activation: megalite uses exact GeLU (Megatron's default); original GPT-2 checkpoints
  use the tanh approximation (``gelu_new``), so logits of converted OpenAI weights differ
  slightly (~1e-3) unless the model uses the same approximation.
"""

from __future__ import annotations

from megalite.models.families.names import NameTable, Rename, weight_and_bias
from megalite.models.families.spec import FamilySpec, attention_variant_problems


class GPT2Spec(FamilySpec):
    name = "gpt2"
    hf_model_type = "gpt2"
    hf_architecture = "GPT2LMHeadModel"
    defaults = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
                "swiglu": False, "add_bias_linear": True,
                "untie_embeddings_and_output_weights": False}
    ignored_hf_suffixes = (".attn.bias",)

    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        return [text for bad, text in [
            (c.position_embedding_type != "learned_absolute",
             f"position embeddings {c.position_embedding_type!r} (GPT-2: learned_absolute)"),
            (c.position_embedding_type == "learned_absolute" and not c.add_position_embedding,
             "no position table (--no-position-embedding; GPT-2 has learned positions)"),
            (c.normalization != "LayerNorm", f"{c.normalization} (GPT-2: LayerNorm)"),
            (c.swiglu, "SwiGLU (GPT-2: GeLU)"),
            (c.num_experts is not None, "experts (--num-experts)"),
            (c.num_query_groups != c.num_attention_heads, "grouped-query attention"),
            (c.kv_channels * c.num_attention_heads != c.hidden_size,
             f"kv_channels x heads ({c.kv_channels} x {c.num_attention_heads}) != hidden "
             f"size ({c.hidden_size})"),
        ] if bad] + attention_variant_problems(c)

    def name_table(self, model_cfg) -> NameTable:
        return NameTable(
            hf_layer_prefix="transformer.h.{}.",
            globals=(Rename("embedding.word_embeddings.weight", "transformer.wte.weight"),
                     Rename("embedding.position_embeddings.weight", "transformer.wpe.weight"),
                     *weight_and_bias("decoder.final_layernorm", "transformer.ln_f")),
            layer=(*weight_and_bias("input_layernorm", "ln_1"),
                   *weight_and_bias("self_attention.linear_qkv", "attn.c_attn", transpose=True),
                   *weight_and_bias("self_attention.linear_proj", "attn.c_proj", transpose=True),
                   *weight_and_bias("pre_mlp_layernorm", "ln_2"),
                   *weight_and_bias("mlp.linear_fc1", "mlp.c_fc", transpose=True),
                   *weight_and_bias("mlp.linear_fc2", "mlp.c_proj", transpose=True)),
            tied=not model_cfg.untie_embeddings_and_output_weights)

    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import GPT2Config

        self.check(model_cfg)
        c = model_cfg
        hf_cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings,
                            n_embd=c.hidden_size, n_layer=c.num_layers,
                            n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                            activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, layer_norm_epsilon=c.norm_epsilon,
                            tie_word_embeddings=not c.untie_embeddings_and_output_weights)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def config_from_hf(self, hf_cfg) -> dict:
        """GPT-2's tanh-approximated GeLU (``gelu_new``) becomes megalite's exact GeLU (see
        :meth:`conversion_warnings`)."""
        h = hf_cfg.n_embd
        return {**self.defaults,
                "num_layers": hf_cfg.n_layer, "hidden_size": h,
                "num_attention_heads": hf_cfg.n_head, "ffn_hidden_size": hf_cfg.n_inner or 4 * h,
                "vocab_size": hf_cfg.vocab_size, "max_position_embeddings": hf_cfg.n_positions,
                "seq_length": hf_cfg.n_positions, "norm_epsilon": hf_cfg.layer_norm_epsilon,
                "untie_embeddings_and_output_weights": not hf_cfg.tie_word_embeddings}

    def conversion_warnings(self, hf_cfg) -> list[str]:
        act = hf_cfg.activation_function
        if act == "gelu":
            return []
        return [f"activation {act!r}: megalite's GPT-2 uses exact GeLU, so logits will "
                "differ slightly"]


SPEC = GPT2Spec()
