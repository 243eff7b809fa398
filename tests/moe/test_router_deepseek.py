"""Routing of DeepSeek-V3 / Kimi-K2 / Qwen3-MoE: group-limited top-k, the expert bias,
pre-softmax, the router dtype and forced balancing; against transformers and by hand."""

import pytest
import torch

from megalite.config import ConfigError, ModelConfig, ParallelConfig
from megalite.moe.router import TopKRouter, counting, group_limited_topk, topk_probs
from megalite.parallel.state import ParallelState


def _state():
    return ParallelState.build(ParallelConfig())


def _router(h=16, **kw):
    cfg = ModelConfig(hidden_size=h, **kw)
    router = TopKRouter(cfg, _state())
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return router


@pytest.mark.parametrize("E,k,groups,group_topk", [(64, 8, 8, 4), (16, 4, 4, 2), (8, 2, 1, 1)])
def test_matches_transformers_deepseek_v3_gate(E, k, groups, group_topk):
    """Routing map and weights equal DeepseekV3TopkRouter's on random tokens, with a random
    ``e_score_correction_bias`` (megalite's ``expert_bias``) and a scaling factor."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=16, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
        topk_group=group_topk, routed_scaling_factor=2.5, norm_topk_prob=True))
    router = _router(num_experts=E, moe_router_topk=k, moe_router_score_function="sigmoid",
                     moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                     moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True)
    gen = torch.Generator().manual_seed(E + k)
    with torch.no_grad():
        hf.weight.copy_(router.weight)
        bias = torch.randn(E, generator=gen) * 0.1
        hf.e_score_correction_bias.copy_(bias)
        router.expert_bias.copy_(bias)
    x = torch.randn(12, 3, 16, generator=gen)
    _, hf_weights, hf_idx = hf(x)
    routing = router(x)
    want_map = torch.zeros(36, E, dtype=torch.bool).scatter(1, hf_idx, True)
    want_probs = torch.zeros(36, E).scatter(1, hf_idx, hf_weights)
    assert torch.equal(routing.routing_map, want_map)
    torch.testing.assert_close(routing.probs, want_probs, rtol=1e-6, atol=1e-7)
    # the bias moves the choice: without it other experts win somewhere
    with torch.no_grad():
        router.expert_bias.zero_()
    assert not torch.equal(router(x).routing_map, want_map)


def test_group_limited_topk_by_hand():
    # 2 tokens, 6 experts in 3 groups of 2, k = 2 from one group: a group scores the sum
    # of its top k // group_topk = 2 experts
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.1, 0.2],
                           [0.1, 0.1, 0.8, 0.0, 0.7, 0.6]])
    values, idx = group_limited_topk(scores, 2, 3, 1)
    # token 0: group sums 0.9, 1.0, 0.3 -> group 1 (experts 2, 3) although expert 0 is best
    assert sorted(idx[0].tolist()) == [2, 3]
    # token 1: group sums 0.2, 0.8, 1.3 -> group 2 (experts 4, 5)
    assert idx[1].tolist() == [4, 5]
    torch.testing.assert_close(values[1], torch.tensor([0.7, 0.6]))
    # two groups of the three, k = 2: each group scores its best expert
    _, idx = group_limited_topk(scores, 2, 3, 2)
    assert idx[0].tolist() == [0, 2] or idx[0].tolist() == [0, 3]
    assert idx[1].tolist() == [2, 4]


def test_pre_softmax_is_softmax_over_all_then_topk():
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    probs, idx = topk_probs(logits, 2, "softmax", pre_softmax=True)
    top, want_idx = torch.softmax(logits, -1).topk(2, dim=-1)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(probs, top)   # not renormalized
    assert (probs.sum(-1) < 1).all()
    # with groups and a scaling factor: the groups are scored on the softmax
    probs, idx = topk_probs(logits, 2, "softmax", 3.0, pre_softmax=True, num_groups=2,
                            group_topk=1)
    scores = torch.softmax(logits, -1)
    values, want = group_limited_topk(scores, 2, 2, 1)
    assert torch.equal(idx, want)
    torch.testing.assert_close(probs, values * 3.0)


def test_router_dtype_fp64():
    router = _router(num_experts=4, moe_router_dtype="fp64", moe_aux_loss_coeff=0.1)
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))
    routing = router(x)
    assert routing.probs.dtype == torch.float64 and routing.loss.dtype == torch.float64
    ref = _router(num_experts=4)(x)
    assert torch.equal(routing.routing_map, ref.routing_map)
    torch.testing.assert_close(routing.probs.float(), ref.probs)


def test_force_load_balancing_routes_evenly_and_passes_gradient():
    router = _router(num_experts=8, moe_router_topk=2, moe_router_force_load_balancing=True)
    real = _router(num_experts=8, moe_router_topk=2)
    with torch.no_grad():   # a router that sends every token to experts 0 and 1
        for r in (router, real):
            r.weight.zero_()
            r.weight[:2, 0] = 10.0
    x = torch.randn(1024, 2, 16, generator=torch.Generator().manual_seed(3)).abs()
    assert real(x).routing_map[:, :2].all()
    routing = router(x)
    load = routing.routing_map.sum(0).float()
    assert load.max() / load.min() < 1.3, load
    routing.probs.square().sum().backward()   # straight-through to the real logits
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_expert_load_counts_once_per_token_choice():
    router = _router(num_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True)
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
    routing = router(x)
    torch.testing.assert_close(router.tokens_per_expert,
                               routing.routing_map.sum(0).double())
    with torch.no_grad():   # evaluation: not counted
        router(x)
    assert router.tokens_per_expert.sum() == 24
    # recomputed inside backward (full recompute): counted once
    out = torch.utils.checkpoint.checkpoint(lambda t: router(t).probs, x, use_reentrant=False)
    out.sum().backward()
    assert router.tokens_per_expert.sum() == 48
    router.reset_load()
    assert router.tokens_per_expert.sum() == 0 and counting()
    assert "expert_bias" in router.state_dict() and "tokens_per_expert" not in \
        router.state_dict()


@pytest.mark.parametrize("kw,match", [
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "must be <= moe_router_num"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "divisible by moe_router_num"),
    ({"moe_router_num_groups": 4}, "needs both"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 4}, "<= moe_router_topk"),
    ({"moe_router_enable_expert_bias": True}, "needs --moe-router-score-function sigmoid"),
    ({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
      "moe_expert_capacity_factor": 1.0}, "balances a dropless router"),
    ({"moe_router_bias_update_rate": 0.0}, "must be positive"),
])
def test_bad_routing_settings_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(num_experts=8, moe_router_topk=2, **kw)


def test_experts_not_divisible_over_ep_is_refused():
    cfg = ModelConfig(num_experts=6, moe_router_num_groups=3, moe_router_group_topk=1)
    with pytest.raises(ConfigError, match="divisible by expert_model_parallel_size"):
        cfg.check_layout(1, 1, 4)


def test_megatron_args_carry_the_routing_and_refuse_what_megalite_lacks():
    from argparse import Namespace

    from megalite.checkpoint.megatron.arguments import megatron_args, unsupported
    from megalite.config import MegaliteConfig

    model = ModelConfig(num_layers=3, num_experts=8, moe_router_score_function="sigmoid",
                        moe_router_num_groups=4, moe_router_group_topk=2,
                        moe_router_enable_expert_bias=True, moe_layer_freq="[0]+[1]*2",
                        vocab_size=60)
    args = megatron_args(MegaliteConfig(model=model))
    assert args.moe_layer_freq == [0, 1, 1]
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (4, 2)
    assert args.moe_router_enable_expert_bias and not args.moe_router_pre_softmax
    # the routing converts both ways (tests/checkpoint/test_megatron_*.py); what megalite
    # lacks is refused, in one line each
    assert unsupported(args) == []
    assert unsupported(Namespace(num_experts=8)) == []
    problems = unsupported(Namespace(num_experts=8, moe_shared_expert_gate=True,
                                     moe_router_score_function="sqrtsoftplus"))
    assert problems == ["--moe-shared-expert-gate",
                        "--moe-router-score-function sqrtsoftplus"]
