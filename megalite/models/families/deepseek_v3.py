"""DeepSeek-V3: multi-latent attention, the first ``first_k_dense_replace`` layers dense
(SwiGLU), the rest MoE with sigmoid group-limited routing, an expert bias and shared
experts (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight share the architecture).

The tensor names are :mod:`megalite.models.families.deepseek_base`'s (shared with
DeepSeek-V2), plus the router's correction bias per MoE layer:

=================================  ===========================================================
megalite                           transformers
=================================  ===========================================================
``mlp.router.expert_bias``         ``mlp.gate.e_score_correction_bias`` ``[E]`` (a buffer)
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

from megalite.models.families.deepseek_base import DEEPSEEK_DEFAULTS, HF_LAYER_PREFIX, DeepseekSpec
from megalite.models.families.deepseek_mtp import mtp_from_hf, mtp_to_hf
from megalite.models.families.names import Rename

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3Spec(DeepseekSpec):
    name = "deepseek_v3"
    hf_model_type = "deepseek_v3"
    hf_architecture = "DeepseekV3ForCausalLM"
    label = "DeepSeek-V3"
    fp32_hf_suffixes = ("e_score_correction_bias",)   # fp32 on the hub; it picks experts
    extra_layer_renames = (Rename("mlp.router.expert_bias",
                                  "mlp.gate.e_score_correction_bias"),)
    defaults = {**DEEPSEEK_DEFAULTS, "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True}

    # -- the router ----------------------------------------------------------------------
    def router_problems(self, model_cfg) -> list[str]:
        c = model_cfg
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
        return [text for bad, text in [
            (c.moe_router_score_function != "sigmoid",
             f"--moe-router-score-function {c.moe_router_score_function} (needs sigmoid)"),
            (c.moe_router_pre_softmax, "--moe-router-pre-softmax"),
            (not c.moe_router_enable_expert_bias,
             "no --moe-router-enable-expert-bias (HF's e_score_correction_bias)"),
            (groups is not None and gk is not None and gk < groups
             and c.moe_router_topk // gk != 2,
             f"group scores of the best {c.moe_router_topk // (gk or 1)} experts "
             f"(transformers sums the best 2: --moe-router-topk // "
             f"--moe-router-group-topk must be 2)"),
        ] if bad]

    def hf_router_kwargs(self, model_cfg) -> dict:
        c = model_cfg
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
        if not groups or not gk:
            groups = gk = 1
        return {"n_group": groups, "topk_group": gk, "norm_topk_prob": True,
                "rope_interleave": True, "num_nextn_predict_layers": c.mtp_num_layers or 0}

    def hf_router_problems(self, hf_cfg) -> list[str]:
        h = hf_cfg
        problems = ["norm_topk_prob false"] if not h.norm_topk_prob else []
        groups, gk, k = h.n_group or 1, h.topk_group or 1, h.num_experts_per_tok
        if gk < groups and k // gk != 2:
            problems.append(f"num_experts_per_tok {k} // topk_group {gk} is not 2 (megalite "
                            f"scores a group by its best k // topk_group experts, transformers "
                            f"by its best 2)")
        return problems

    def router_from_hf(self, hf_cfg) -> dict:
        h = hf_cfg
        groups, gk = h.n_group or 1, h.topk_group or 1
        return {"moe_router_num_groups": groups if gk < groups else None,
                "moe_router_group_topk": gk if gk < groups else None,
                "mtp_num_layers": getattr(h, "num_nextn_predict_layers", 0) or None}

    def hf_config_class(self):
        from transformers import DeepseekV3Config

        return DeepseekV3Config

    # -- multi-token prediction ----------------------------------------------------------
    def to_hf(self, state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
        out = super().to_hf(state, model_cfg)
        out.update(mtp_to_hf(state, model_cfg, self.name_table(model_cfg)))
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        out = super().from_hf(hf_state, model_cfg)
        out.update(mtp_from_hf(hf_state, model_cfg, self.name_table(model_cfg)))
        return {k: v.contiguous() for k, v in out.items()}

    def export_warnings(self, model_cfg) -> list[str]:
        """The latent norms' eps only: the MTP depths are written."""
        return self.latent_norm_warnings(model_cfg)

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


SPEC = DeepseekV3Spec()
