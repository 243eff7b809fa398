"""The planner's account of ``--recompute-modules moe``: an MoE layer keeps only the
dispatcher's input (and the router's fp32 tensors) for backward, and the step pays one more
forward of the routed top-k experts and the shared experts."""

from __future__ import annotations

from megalite.config import ModelConfig, ParallelConfig
from megalite.planner.memory import MOE_IMBALANCE, layer_activation_elements

MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
           ffn_hidden_size=128, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_shared_expert_intermediate_size=48, swiglu=True)


def test_moe_recompute_keeps_only_the_dispatcher_input():
    p = ParallelConfig()
    plain = layer_activation_elements(ModelConfig(**MOE), p, 2, moe=True)
    recomputed = layer_activation_elements(ModelConfig(
        **MOE, recompute_granularity="selective", recompute_modules=["moe"]), p, 2, moe=True)
    tokens, h = 32 * 2, 64
    routed = int(tokens * 2 * MOE_IMBALANCE)   # top-2, dropless allowance
    experts = routed * h * 2 + routed * 32 * 3 + routed * h   # permuted, fc1 in/out, out
    shared = tokens * 48 * 3 + tokens * h                     # the shared expert
    assert plain["act"] - recomputed["act"] == experts + shared
    assert plain["fp32"] == recomputed["fp32"]          # the router stays outside
    # a dense layer is not affected by moe (nor by layernorm)
    dense = layer_activation_elements(ModelConfig(
        **MOE, recompute_granularity="selective", recompute_modules=["moe", "layernorm"]),
        p, 2, moe=False)
    assert dense == layer_activation_elements(ModelConfig(**MOE), p, 2, moe=False)
