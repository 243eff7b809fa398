"""The MoE router's flags (``--moe-router-*``): the checks.

The router itself is :mod:`megalite.moe.router`; here only what the flags may be and what
they may be combined with.
"""

from __future__ import annotations

from megalite.config.fields import positive, require


def check_router(m) -> None:
    """Group-limited routing, pre-softmax and the expert bias (Megatron's rules); ``m``
    a ModelConfig."""
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    positive(m, "moe_router_num_groups", "moe_router_group_topk")
    require((groups is None) == (group_topk is None),
            "group-limited routing needs both --moe-router-num-groups and "
            "--moe-router-group-topk")
    require(m.moe_router_bias_update_rate > 0,
            f"moe_router_bias_update_rate must be positive, got "
            f"{m.moe_router_bias_update_rate}")
    if m.num_experts is None:
        return
    E, k = m.num_experts, m.moe_router_topk
    if groups is not None:
        require(E % groups == 0,
                f"num_experts ({E}) must be divisible by moe_router_num_groups "
                f"({groups}): every group holds the same number of experts")
        require(group_topk <= groups,
                f"moe_router_group_topk ({group_topk}) must be <= moe_router_num_groups "
                f"({groups})")
        require(group_topk <= k,
                f"moe_router_group_topk ({group_topk}) must be <= moe_router_topk ({k}): "
                f"a group is scored by its top moe_router_topk / moe_router_group_topk "
                f"experts")
        require(k // group_topk <= E // groups and group_topk * (E // groups) >= k,
                f"moe_router_topk ({k}) cannot be chosen from moe_router_group_topk "
                f"({group_topk}) groups of {E // groups} experts")
    if m.moe_router_enable_expert_bias:
        require(m.moe_router_score_function == "sigmoid",
                "--moe-router-enable-expert-bias needs --moe-router-score-function "
                "sigmoid (the bias is added to the sigmoid scores, as in DeepSeek-V3)")
        require(m.moe_expert_capacity_factor is None,
                "--moe-router-enable-expert-bias balances a dropless router: with "
                "--moe-expert-capacity-factor the tokens over capacity are dropped, so "
                "the load the bias steers is not what the experts compute; drop one of "
                "the two")
