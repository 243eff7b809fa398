"""DeepSeek-V2 and DeepSeek-V2-Lite (``DeepseekV2ForCausalLM``): DeepSeek-V3's layers
(:mod:`megalite.models.families.deepseek_base`: multi-latent attention, dense first layers,
routed and shared experts, the same tensor names) with softmax routing and neither an
expert bias nor multi-token prediction.

transformers' ``DeepseekV2TopkRouter`` takes the softmax of the fp32 router logits over
all E experts, keeps the top ``num_experts_per_tok`` of those probabilities as they are
(never renormalized: it ignores ``norm_topk_prob``) and multiplies them by
``routed_scaling_factor``. In megalite's flags that is

=================================  ===========================================================
transformers config                megalite
=================================  ===========================================================
softmax scores, not renormalized   ``--moe-router-score-function softmax``
                                   ``--moe-router-pre-softmax``
``routed_scaling_factor``          ``--moe-router-topk-scaling-factor``
``topk_method "greedy"``           plain top-k (``n_group`` / ``topk_group`` unused)
``topk_method                      ``--moe-router-num-groups n_group``
"group_limited_greedy"``           ``--moe-router-group-topk topk_group``
``first_k_dense_replace``          ``--moe-layer-freq "[0]*k+[1]*(L-k)"``
``n_shared_experts``               ``--moe-shared-expert-intermediate-size`` =
                                   ``n_shared_experts x moe_intermediate_size``
=================================  ===========================================================

Refused, with one error naming the field:

* ``group_limited_greedy`` where ``num_experts_per_tok // topk_group`` is not 1 (and not
  every group is kept, ``topk_group < n_group``): transformers scores a group by its best
  expert, megalite's group-limited top-k by the sum of its best ``topk // group_topk``, so
  the two agree only when that is one. DeepSeek-V2's own 6 // 3 = 2 is refused;
  DeepSeek-V2-Lite (greedy) converts.
* ``norm_topk_prob`` true: transformers' DeepSeek-V2 never renormalizes whatever the
  field says, while DeepSeek's reference code does, so the checkpoint's meaning is
  ambiguous (every DeepSeek-V2 hub config has it false).
* another ``topk_method`` (``noaux_tc`` is DeepSeek-V3's routing: that model type).

An export writes no multi-token prediction depths (``--mtp-num-layers``: the format has
no place for them) and says so.
"""

from __future__ import annotations

from megalite.models.families.deepseek_base import DEEPSEEK_DEFAULTS, DeepseekSpec

GREEDY, GROUP_LIMITED = "greedy", "group_limited_greedy"


class DeepseekV2Spec(DeepseekSpec):
    name = "deepseek_v2"
    hf_model_type = "deepseek_v2"
    hf_architecture = "DeepseekV2ForCausalLM"
    label = "DeepSeek-V2"
    defaults = {**DEEPSEEK_DEFAULTS, "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": True}

    def router_problems(self, model_cfg) -> list[str]:
        c = model_cfg
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
        return [text for bad, text in [
            (c.moe_router_score_function != "softmax",
             f"--moe-router-score-function {c.moe_router_score_function} (needs softmax)"),
            (c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax,
             "no --moe-router-pre-softmax (DeepSeek-V2 weights an expert by its softmax "
             "over all experts, not renormalized over the chosen)"),
            (c.moe_router_enable_expert_bias,
             "--moe-router-enable-expert-bias (DeepSeek-V2 has no expert bias)"),
            (groups is not None and gk is not None and gk < groups
             and c.moe_router_topk // gk != 1,
             f"group scores of the best {c.moe_router_topk // (gk or 1)} experts "
             f"(transformers' group_limited_greedy scores a group by its best expert: "
             f"--moe-router-topk // --moe-router-group-topk must be 1)"),
        ] if bad]

    def hf_router_kwargs(self, model_cfg) -> dict:
        c = model_cfg
        groups, gk = c.moe_router_num_groups, c.moe_router_group_topk
        if groups and gk and gk < groups:
            return {"topk_method": GROUP_LIMITED, "n_group": groups, "topk_group": gk,
                    "norm_topk_prob": False}
        return {"topk_method": GREEDY, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}

    def hf_router_problems(self, hf_cfg) -> list[str]:
        h = hf_cfg
        method, k = h.topk_method, h.num_experts_per_tok
        groups, gk = h.n_group, h.topk_group
        problems = ["norm_topk_prob true (transformers' DeepSeek-V2 ignores it and never "
                    "renormalizes, DeepSeek's reference code renormalizes: megalite "
                    "converts norm_topk_prob false only)"] if h.norm_topk_prob else []
        if method not in (GREEDY, GROUP_LIMITED):
            problems.append(f"topk_method {method!r} (megalite converts {GREEDY!r} and "
                            f"{GROUP_LIMITED!r})")
        elif method == GROUP_LIMITED and (not groups or not gk):
            problems.append(f"topk_method {GROUP_LIMITED!r} without n_group / topk_group "
                            f"(n_group {groups}, topk_group {gk})")
        elif method == GROUP_LIMITED and gk < groups and k // gk != 1:
            problems.append(f"topk_method {GROUP_LIMITED!r} with num_experts_per_tok {k} // "
                            f"topk_group {gk} = {k // gk} (transformers scores a group by its "
                            f"best expert, megalite by the sum of its best "
                            f"num_experts_per_tok // topk_group: they agree only when that "
                            f"is 1)")
        return problems

    def router_from_hf(self, hf_cfg) -> dict:
        h = hf_cfg
        limited = h.topk_method == GROUP_LIMITED and h.topk_group < h.n_group
        return {"moe_router_num_groups": h.n_group if limited else None,
                "moe_router_group_topk": h.topk_group if limited else None}

    def hf_config_class(self):
        from transformers import DeepseekV2Config

        return DeepseekV2Config


SPEC = DeepseekV2Spec()
