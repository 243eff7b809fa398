"""What DeepSeek-V2 and DeepSeek-V3 share: :class:`DeepseekSpec`, the base of both specs.

Both architectures are multi-latent attention, the first ``first_k_dense_replace`` layers
dense (SwiGLU), the rest MoE with routed experts and shared experts. They differ in the
router only (V2: softmax scores, no expert bias, ``topk_method``; V3: sigmoid scores, the
correction bias, multi-token prediction), which the subclasses supply through
:meth:`DeepseekSpec.router_problems`, :meth:`DeepseekSpec.hf_router_kwargs`,
:meth:`DeepseekSpec.hf_router_problems` and :meth:`DeepseekSpec.router_from_hf`.

Per layer ``i`` (``decoder.layers.{i}.`` <-> ``model.layers.{i}.``):

=================================  ===========================================================
megalite                           transformers
=================================  ===========================================================
``self_attention.linear_q_down``   ``self_attn.q_a_proj``; ``q_layernorm`` = ``q_a_layernorm``
``_proj`` / ``linear_q_up_proj``   ``q_b_proj`` (``linear_q_proj`` = ``q_proj`` without a
                                   query latent, ``q_lora_rank`` None)
``linear_kv_down_proj``            ``kv_a_proj_with_mqa``; ``kv_layernorm`` = ``kv_a_layernorm``
``linear_kv_up_proj``              ``kv_b_proj``; ``linear_proj`` = ``o_proj``
``mlp.linear_fc1`` (dense layers)  ``mlp.gate_proj`` ; ``mlp.up_proj`` stacked; ``linear_fc2``
                                   = ``mlp.down_proj``
``mlp.router.weight``              ``mlp.gate.weight`` ``[E, h]``
``mlp.experts.fc1 [E, h, 2f]``     ``mlp.experts.gate_up_proj [E, 2f, h]`` transposed (hub
                                   files: ``mlp.experts.{j}.gate_proj`` / ``up_proj``)
``mlp.experts.fc2 [E, f, h]``      ``mlp.experts.down_proj [E, h, f]`` transposed (hub files:
                                   ``mlp.experts.{j}.down_proj``)
``mlp.shared_experts.fc1 / fc2``   ``mlp.shared_experts.gate_proj ; up_proj`` / ``down_proj``
=================================  ===========================================================

RoPE: both rotate interleaved pairs of the key/query RoPE part (V3 with ``rope_interleave``
true, V2 always), as megalite's multi-latent attention does; YaRN's ``mscale`` /
``mscale_all_dim`` carry over as megalite's ``--mscale`` / ``--mscale-all-dim``.
"""

from __future__ import annotations

import torch

from megalite.models.families.experts import (
    experts_from_hf,
    experts_to_hf,
    experts_to_hub_names,
)
from megalite.models.families.llama import MAX_SEQ_LENGTH
from megalite.models.families.names import (
    OUR_LAYER_PREFIX,
    Fuse,
    NameTable,
    Rename,
)
from megalite.models.families.spec import FamilySpec

HF_LAYER_PREFIX = "model.layers.{}."
LATENT_NORM_EPS = 1e-6  # transformers' q_a / kv_a_layernorm eps, whatever rms_norm_eps

# megalite MLA module -> transformers DeepseekV2/V3Attention module
MLA_NAMES = (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
             ("linear_q_up_proj", "q_b_proj"), ("linear_q_proj", "q_proj"),
             ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
             ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"))


def moe_layer_freq(num_layers: int, dense: int) -> str | int:
    """Megatron's ``--moe-layer-freq`` for ``dense`` dense layers first, then MoE."""
    return 1 if dense == 0 else f"[0]*{dense}+[1]*{num_layers - dense}"


def dense_layers(model_cfg) -> int:
    """How many dense layers precede the first MoE layer (all of them without MoE)."""
    pattern = list(model_cfg.moe_layer_pattern)
    return pattern.index(1) if 1 in pattern else len(pattern)


# the ModelConfig defaults DeepSeek-V2 and V3 share; each adds its router's
DEEPSEEK_DEFAULTS = {"position_embedding_type": "rope", "normalization": "RMSNorm",
                     "swiglu": True, "add_bias_linear": False,
                     "untie_embeddings_and_output_weights": True,
                     "multi_latent_attention": True, "qk_layernorm": True,
                     "num_experts": 8, "moe_router_topk": 2, "moe_router_dtype": "fp32",
                     "moe_router_load_balancing_type": "seq_aux_loss",
                     "moe_ffn_hidden_size": 128, "moe_shared_expert_intermediate_size": 128,
                     "norm_epsilon": 1e-6}


class DeepseekSpec(FamilySpec):
    """MLA + dense-then-MoE layers with shared experts; the router is the subclass's."""

    label: str                    # the architecture's name in messages: "DeepSeek-V3"
    extra_layer_renames: tuple[Rename, ...] = ()   # router tensors beyond the weight

    # -- the router: subclasses ----------------------------------------------------------
    def router_problems(self, model_cfg) -> list[str]:
        """What keeps the model's routing from being this architecture's."""
        raise NotImplementedError

    def hf_router_kwargs(self, model_cfg) -> dict:
        """The transformers config's routing fields for ``model_cfg``."""
        raise NotImplementedError

    def hf_router_problems(self, hf_cfg) -> list[str]:
        """The routing settings of ``hf_cfg`` megalite does not compute alike."""
        raise NotImplementedError

    def router_from_hf(self, hf_cfg) -> dict:
        """``ModelConfig`` routing keyword arguments for ``hf_cfg``."""
        raise NotImplementedError

    def hf_config_class(self):
        raise NotImplementedError

    # -- which models --------------------------------------------------------------------
    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        pattern = list(c.moe_layer_pattern) if c.num_experts is not None else []
        dense = pattern.index(1) if 1 in pattern else len(pattern)
        return [text for bad, text in [
            (not c.multi_latent_attention, "no --multi-latent-attention"),
            (c.multi_latent_attention and not c.qk_layernorm,
             "no --qk-layernorm (the q/kv latent norms)"),
            (c.position_embedding_type != "rope",
             f"position embeddings {c.position_embedding_type!r} (needs rope)"),
            (c.normalization != "RMSNorm", f"{c.normalization} (needs RMSNorm)"),
            (not c.swiglu, "no SwiGLU"),
            (c.add_bias_linear or c.add_qkv_bias, "linear biases"),
            (c.apply_layernorm_1p, "--apply-layernorm-1p"),
            (c.num_experts is None, "--num-experts is not set"),
            (c.num_experts is not None and pattern != [0] * dense + [1] * (len(pattern) - dense),
             f"--moe-layer-freq {c.moe_layer_freq} ({self.label}: dense layers first, then "
             f"MoE)"),
            (not c.moe_shared_expert_intermediate_size, "no shared experts"),
            (bool(c.moe_shared_expert_intermediate_size) and c.num_experts is not None
             and c.moe_shared_expert_intermediate_size % c.moe_ffn_hidden_size,
             "--moe-shared-expert-intermediate-size not a multiple of "
             "--moe-ffn-hidden-size (HF: n_shared_experts x moe_intermediate_size)"),
            (c.rotary_scaling_factor != 1.0 and not c.mscale_all_dim and c.mscale != 1.0,
             "--mscale without --mscale-all-dim (transformers then scales by "
             "mscale(factor, 1))"),
        ] if bad] + self.router_problems(c)

    # -- tensors -------------------------------------------------------------------------
    def name_table(self, model_cfg) -> NameTable:
        c = model_cfg
        f, fs = c.ffn_hidden_size, c.moe_shared_expert_intermediate_size
        attn = tuple(Rename(f"self_attention.{ours}.weight", f"self_attn.{hf}.weight")
                     for ours, hf in MLA_NAMES)
        return NameTable(
            hf_layer_prefix=HF_LAYER_PREFIX,
            globals=(Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                     Rename("decoder.final_layernorm.weight", "model.norm.weight")),
            layer=(Rename("input_layernorm.weight", "input_layernorm.weight"), *attn,
                   Rename("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                   Rename("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
                   Rename("mlp.router.weight", "mlp.gate.weight"),
                   *self.extra_layer_renames,
                   Rename("mlp.shared_experts.fc2.weight",
                          "mlp.shared_experts.down_proj.weight")),
            fused=(Fuse("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                        (f, f)),
                   Fuse("mlp.shared_experts.fc1.weight",
                        ("mlp.shared_experts.gate_proj.weight",
                         "mlp.shared_experts.up_proj.weight"), (fs, fs))),
            tied=not c.untie_embeddings_and_output_weights)

    def to_hf(self, state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
        out = super().to_hf(state, model_cfg)
        for i in range(model_cfg.num_layers):
            ours, hf = OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i) + "mlp."
            out.update(experts_to_hf(state, ours, hf))
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        out = super().from_hf(hf_state, model_cfg)
        for i in range(model_cfg.num_layers):
            ours, hf = OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i) + "mlp."
            out.update(experts_from_hf(hf_state, hf, ours, model_cfg.num_experts))
        return {k: v.contiguous() for k, v in out.items()}

    def to_hub_names(self, hf_state: dict[str, torch.Tensor], model_cfg
                     ) -> dict[str, torch.Tensor]:
        """Fused expert tensors -> the hub files' per-expert tensors."""
        return experts_to_hub_names(hf_state, model_cfg.moe_ffn_hidden_size)

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        self.check(model_cfg)
        c = model_cfg
        rope = {"rope_type": "default", "rope_theta": c.rotary_base}
        if c.rotary_scaling_factor != 1.0:
            rope = {"rope_type": "yarn", "rope_theta": c.rotary_base,
                    "factor": c.rotary_scaling_factor, "mscale": c.mscale,
                    "mscale_all_dim": c.mscale_all_dim,
                    "original_max_position_embeddings": c.original_max_position_embeddings
                    or 4096, "beta_fast": 32.0, "beta_slow": 1.0}
        hf_cfg = self.hf_config_class()(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.ffn_hidden_size, moe_intermediate_size=c.moe_ffn_hidden_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_attention_heads,
            n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
            n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
            routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
            first_k_dense_replace=dense_layers(c),
            kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
            qk_rope_head_dim=c.qk_pos_emb_head_dim, qk_nope_head_dim=c.qk_head_dim,
            v_head_dim=c.v_head_dim, hidden_act="silu",
            max_position_embeddings=max(c.max_position_embeddings, c.seq_length),
            rms_norm_eps=c.norm_epsilon, rope_parameters=rope, attention_bias=False,
            tie_word_embeddings=not c.untie_embeddings_and_output_weights,
            **self.hf_router_kwargs(c))
        return self.with_token_ids(hf_cfg, c, token_ids)

    def conversion_warnings(self, hf_cfg) -> list[str]:
        eps = hf_cfg.rms_norm_eps
        return [] if eps == LATENT_NORM_EPS else [
            f"rms_norm_eps {eps}: transformers applies the q/kv latent norms with eps "
            f"{LATENT_NORM_EPS} whatever rms_norm_eps, megalite with --norm-epsilon {eps} "
            f"(the logits differ slightly)"]

    def latent_norm_warnings(self, model_cfg) -> list[str]:
        eps = model_cfg.norm_epsilon
        return [] if eps == LATENT_NORM_EPS else [
            f"--norm-epsilon {eps}: transformers' {self.label} applies the q/kv latent norms "
            f"with eps {LATENT_NORM_EPS} whatever rms_norm_eps, so its logits differ "
            f"slightly from this model's (train with --norm-epsilon {LATENT_NORM_EPS} for an "
            f"exact match)"]

    def export_warnings(self, model_cfg) -> list[str]:
        return self.latent_norm_warnings(model_cfg) + super().export_warnings(model_cfg)

    def config_from_hf(self, hf_cfg) -> dict:
        """``ValueError`` for what megalite's model cannot be: interleave off, biases, a
        routing it does not compute alike (:meth:`hf_router_problems`)."""
        h = hf_cfg
        heads = h.num_attention_heads
        problems = [text for bad, text in [
            ((h.num_key_value_heads or heads) != heads,
             f"num_key_value_heads {h.num_key_value_heads} != num_attention_heads {heads}"),
            (h.attention_bias, "attention_bias"),
            (getattr(h, "mlp_bias", False), "mlp_bias"),
            (not getattr(h, "rope_interleave", True), "rope_interleave false"),
            (h.hidden_act != "silu", f"hidden_act {h.hidden_act!r}"),
            (not h.n_shared_experts, "no shared experts"),
        ] if bad] + self.hf_router_problems(h)
        if problems:
            raise ValueError(f"{self.label} config megalite cannot represent: "
                             + "; ".join(problems))
        rope = dict(getattr(h, "rope_parameters", None) or {})
        kind = rope.get("rope_type", "default")
        yarn = {}
        if kind == "yarn":
            if (rope.get("beta_fast", 32) or 32, rope.get("beta_slow", 1) or 1) != (32, 1):
                raise ValueError("YaRN beta_fast / beta_slow other than 32 / 1 are not "
                                 "supported")
            # without mscale_all_dim transformers scales cos/sin by mscale(factor, 1)
            yarn = {"rotary_scaling_factor": float(rope["factor"]),
                    "mscale": float(rope.get("mscale") or 1.0)
                    if rope.get("mscale_all_dim") else 1.0,
                    "mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
                    "original_max_position_embeddings":
                        int(rope.get("original_max_position_embeddings") or 4096)}
        elif kind != "default":
            raise ValueError(f"rope scaling {kind!r} is not supported")
        layers, dense = h.num_hidden_layers, min(h.first_k_dense_replace or 0,
                                                 h.num_hidden_layers)
        return {**self.defaults,
                "num_layers": layers, "hidden_size": h.hidden_size,
                "num_attention_heads": heads, "ffn_hidden_size": h.intermediate_size,
                "vocab_size": h.vocab_size,
                "max_position_embeddings": h.max_position_embeddings,
                "seq_length": min(h.max_position_embeddings, MAX_SEQ_LENGTH),
                "rotary_base": float(rope.get("rope_theta", 10000.0)),
                "norm_epsilon": h.rms_norm_eps,
                "untie_embeddings_and_output_weights": not h.tie_word_embeddings,
                "q_lora_rank": h.q_lora_rank, "kv_lora_rank": h.kv_lora_rank,
                "qk_head_dim": h.qk_nope_head_dim, "qk_pos_emb_head_dim": h.qk_rope_head_dim,
                "v_head_dim": h.v_head_dim, **yarn,
                "num_experts": h.n_routed_experts, "moe_router_topk": h.num_experts_per_tok,
                "moe_ffn_hidden_size": h.moe_intermediate_size,
                "moe_shared_expert_intermediate_size":
                    h.moe_intermediate_size * h.n_shared_experts,
                "moe_layer_freq": moe_layer_freq(layers, dense),
                "moe_router_topk_scaling_factor": float(h.routed_scaling_factor),
                **self.router_from_hf(h)}
