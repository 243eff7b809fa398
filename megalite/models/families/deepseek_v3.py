"""DeepSeek-V3: multi-latent attention, the first ``first_k_dense_replace`` layers dense
(SwiGLU), the rest MoE with sigmoid group-limited routing, an expert bias and shared
experts (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight share the architecture).

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
``mlp.router.expert_bias``         ``mlp.gate.e_score_correction_bias`` ``[E]`` (a buffer)
``mlp.experts.fc1 [E, h, 2f]``     ``mlp.experts.gate_up_proj [E, 2f, h]`` transposed (hub
                                   files: ``mlp.experts.{j}.gate_proj`` / ``up_proj``)
``mlp.experts.fc2 [E, f, h]``      ``mlp.experts.down_proj [E, h, f]`` transposed (hub files:
                                   ``mlp.experts.{j}.down_proj``)
``mlp.shared_experts.fc1 / fc2``   ``mlp.shared_experts.gate_proj ; up_proj`` / ``down_proj``
=================================  ===========================================================

Routing equals ``DeepseekV3TopkRouter``'s when a group scores the sum of its best
``topk // topk_group`` experts, as megalite's group-limited top-k does and transformers'
does with its fixed two: so ``num_experts_per_tok // topk_group`` must be 2 (DeepSeek-V3's
8 // 4, Kimi-K2's 8 // 1 is refused) unless every group is kept anyway (``topk_group >=
n_group``), when group scores choose nothing.

Multi-token prediction: hub checkpoints keep ``num_nextn_predict_layers`` MTP modules as
extra layer indices ``model.layers.{num_hidden_layers + j}.*`` that transformers never
loads. They become megalite's ``--mtp-num-layers`` depths ``mtp.layers.{j}.`` and back
(:mod:`megalite.models.families.deepseek_mtp`: the depths' own embedding and head must
equal the main model's, which megalite shares); config.json's ``num_nextn_predict_layers``
is ``--mtp-num-layers``. Layer indices past those the converter drops with one note
(:meth:`DeepseekV3Spec.dropped_hf_tensors`).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from megalite.models.families.deepseek_mtp import mtp_from_hf, mtp_to_hf
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
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")

# megalite MLA module -> transformers DeepseekV3Attention module
MLA_NAMES = (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
             ("linear_q_up_proj", "q_b_proj"), ("linear_q_proj", "q_proj"),
             ("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
             ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"))


def moe_layer_freq(num_layers: int, dense: int) -> str | int:
    """Megatron's ``--moe-layer-freq`` for ``dense`` dense layers first, then MoE."""
    return 1 if dense == 0 else f"[0]*{dense}+[1]*{num_layers - dense}"


class DeepseekV3Spec(FamilySpec):
    name = "deepseek_v3"
    hf_model_type = "deepseek_v3"
    hf_architecture = "DeepseekV3ForCausalLM"
    fp32_hf_suffixes = ("e_score_correction_bias",)   # fp32 on the hub; it picks experts
    defaults = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
                "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
                "multi_latent_attention": True, "qk_layernorm": True,
                "num_experts": 8, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32",
                "moe_router_load_balancing_type": "seq_aux_loss",
                "moe_ffn_hidden_size": 128, "moe_shared_expert_intermediate_size": 128,
                "norm_epsilon": 1e-6}

    # -- which models --------------------------------------------------------------------
    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
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
             f"--moe-layer-freq {c.moe_layer_freq} (DeepSeek-V3: dense layers first, then "
             f"MoE)"),
            (not c.moe_shared_expert_intermediate_size, "no shared experts"),
            (bool(c.moe_shared_expert_intermediate_size) and c.num_experts is not None
             and c.moe_shared_expert_intermediate_size % c.moe_ffn_hidden_size,
             "--moe-shared-expert-intermediate-size not a multiple of "
             "--moe-ffn-hidden-size (HF: n_shared_experts x moe_intermediate_size)"),
            (c.moe_router_score_function != "sigmoid",
             f"--moe-router-score-function {c.moe_router_score_function} (needs sigmoid)"),
            (c.moe_router_pre_softmax, "--moe-router-pre-softmax"),
            (c.rotary_scaling_factor != 1.0 and not c.mscale_all_dim and c.mscale != 1.0,
             "--mscale without --mscale-all-dim (transformers then scales by "
             "mscale(factor, 1))"),
            (not c.moe_router_enable_expert_bias,
             "no --moe-router-enable-expert-bias (HF's e_score_correction_bias)"),
            (groups is not None and gk is not None and gk < groups
             and c.moe_router_topk // gk != 2,
             f"group scores of the best {c.moe_router_topk // (gk or 1)} experts "
             f"(transformers sums the best 2: --moe-router-topk // "
             f"--moe-router-group-topk must be 2)"),
        ] if bad]

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
                   Rename("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
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
        out.update(mtp_to_hf(state, model_cfg, self.name_table(model_cfg)))
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        out = super().from_hf(hf_state, model_cfg)
        for i in range(model_cfg.num_layers):
            ours, hf = OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i) + "mlp."
            out.update(experts_from_hf(hf_state, hf, ours, model_cfg.num_experts))
        out.update(mtp_from_hf(hf_state, model_cfg, self.name_table(model_cfg)))
        return {k: v.contiguous() for k, v in out.items()}

    def to_hub_names(self, hf_state: dict[str, torch.Tensor], model_cfg
                     ) -> dict[str, torch.Tensor]:
        """Fused expert tensors -> the hub files' per-expert tensors."""
        return experts_to_hub_names(hf_state, model_cfg.moe_ffn_hidden_size)

    def dropped_hf_tensors(self, hf_state, model_cfg) -> tuple[list[str], str]:
        """Multi-token-prediction modules' tensors past the model's ``--mtp-num-layers``
        depths (layer indices from ``num_layers + mtp_num_layers``) and why they are
        dropped."""
        kept = model_cfg.num_layers + (model_cfg.mtp_num_layers or 0)
        extra = sorted(k for k in hf_state if (m := _HF_LAYER.match(k))
                       and int(m.group(1)) >= kept)
        layers = sorted({int(_HF_LAYER.match(k).group(1)) for k in extra})
        why = (f"multi-token prediction (MTP) layers {layers}: past the model's "
               f"--mtp-num-layers {model_cfg.mtp_num_layers or 0} (transformers does not "
               f"load them either)") if extra else ""
        return extra, why

    def fit_to_weights(self, model_cfg, hf_state):
        """Without the MTP modules' tensors (a checkpoint transformers wrote) the model has
        no prediction depths, whatever ``num_nextn_predict_layers`` says."""
        n = model_cfg.mtp_num_layers or 0
        if n and not any(k.startswith(HF_LAYER_PREFIX.format(model_cfg.num_layers))
                         for k in hf_state):
            return dataclasses.replace(model_cfg, mtp_num_layers=None), (
                f"config.json has num_nextn_predict_layers {n} but the weights hold no "
                f"multi-token prediction module: converted without --mtp-num-layers")
        return model_cfg, ""

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import DeepseekV3Config

        self.check(model_cfg)
        c = model_cfg
        rope = {"rope_type": "default", "rope_theta": c.rotary_base}
        if c.rotary_scaling_factor != 1.0:
            rope = {"rope_type": "yarn", "rope_theta": c.rotary_base,
                    "factor": c.rotary_scaling_factor, "mscale": c.mscale,
                    "mscale_all_dim": c.mscale_all_dim,
                    "original_max_position_embeddings": c.original_max_position_embeddings
                    or 4096, "beta_fast": 32.0, "beta_slow": 1.0}
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
        if not groups or not gk:
            groups = gk = 1
        pattern = list(c.moe_layer_pattern)
        dense = pattern.index(1) if 1 in pattern else len(pattern)
        hf_cfg = DeepseekV3Config(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.ffn_hidden_size, moe_intermediate_size=c.moe_ffn_hidden_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_attention_heads,
            n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
            n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
            routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
            n_group=groups, topk_group=gk, first_k_dense_replace=dense,
            norm_topk_prob=True, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
            qk_rope_head_dim=c.qk_pos_emb_head_dim, qk_nope_head_dim=c.qk_head_dim,
            v_head_dim=c.v_head_dim, hidden_act="silu",
            max_position_embeddings=max(c.max_position_embeddings, c.seq_length),
            rms_norm_eps=c.norm_epsilon, rope_parameters=rope, rope_interleave=True,
            attention_bias=False, num_nextn_predict_layers=c.mtp_num_layers or 0,
            tie_word_embeddings=not c.untie_embeddings_and_output_weights)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def conversion_warnings(self, hf_cfg) -> list[str]:
        eps = hf_cfg.rms_norm_eps
        return [] if eps == LATENT_NORM_EPS else [
            f"rms_norm_eps {eps}: transformers applies the q/kv latent norms with eps "
            f"{LATENT_NORM_EPS} whatever rms_norm_eps, megalite with --norm-epsilon {eps} "
            f"(the logits differ slightly)"]

    def export_warnings(self, model_cfg) -> list[str]:
        eps = model_cfg.norm_epsilon
        return [] if eps == LATENT_NORM_EPS else [
            f"--norm-epsilon {eps}: transformers' DeepSeek-V3 applies the q/kv latent norms "
            f"with eps {LATENT_NORM_EPS} whatever rms_norm_eps, so its logits differ "
            f"slightly from this model's (train with --norm-epsilon {LATENT_NORM_EPS} for an "
            f"exact match)"]

    def config_from_hf(self, hf_cfg) -> dict:
        """``ValueError`` for what megalite's DeepSeek-V3 cannot be: interleave off, biases,
        a routing it does not compute alike."""
        h = hf_cfg
        heads = h.num_attention_heads
        problems = [text for bad, text in [
            ((h.num_key_value_heads or heads) != heads,
             f"num_key_value_heads {h.num_key_value_heads} != num_attention_heads {heads}"),
            (h.attention_bias, "attention_bias"),
            (not getattr(h, "rope_interleave", True), "rope_interleave false"),
            (h.hidden_act != "silu", f"hidden_act {h.hidden_act!r}"),
            (not h.norm_topk_prob, "norm_topk_prob false"),
            (not h.n_shared_experts, "no shared experts"),
        ] if bad]
        groups, gk, k = h.n_group or 1, h.topk_group or 1, h.num_experts_per_tok
        if gk < groups and k // gk != 2:
            problems.append(f"num_experts_per_tok {k} // topk_group {gk} is not 2 (megalite "
                            f"scores a group by its best k // topk_group experts, transformers "
                            f"by its best 2)")
        if problems:
            raise ValueError("DeepSeek-V3 config megalite cannot represent: "
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
                "num_experts": h.n_routed_experts, "moe_router_topk": k,
                "moe_ffn_hidden_size": h.moe_intermediate_size,
                "moe_shared_expert_intermediate_size":
                    h.moe_intermediate_size * h.n_shared_experts,
                "moe_layer_freq": moe_layer_freq(layers, dense),
                "moe_router_topk_scaling_factor": float(h.routed_scaling_factor),
                "moe_router_num_groups": groups if gk < groups else None,
                "moe_router_group_topk": gk if gk < groups else None,
                "mtp_num_layers": getattr(h, "num_nextn_predict_layers", 0) or None}


SPEC = DeepseekV3Spec()
