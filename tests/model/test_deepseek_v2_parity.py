"""DeepSeek-V2: tiny random ``DeepseekV2ForCausalLM`` models converted by the family spec
give transformers' logits within 1e-5 in fp32 and its greedy tokens, in two shapes:
V2-Lite's (no query latent, greedy routing, norm_topk_prob false, two shared experts) and
V2's (query latent, group_limited_greedy routing, a routed scaling factor, YaRN). The name
mapping round-trips bit for bit in both the in-memory and the hub-file naming; the router
equals ``DeepseekV2TopkRouter`` token by token; the configs translate both ways; each
routing megalite does not compute alike is refused with the field named."""

import dataclasses

import pytest
import torch

from megalite.config import ModelConfig
from megalite.models.families import family_of, get_family
from megalite.moe.router import topk_probs
from tests.model.common import TINY
from tests.model import deepseek_parity as parity
from tests.model.deepseek_parity import (
    assert_greedy_generation_matches,
    assert_logits_match,
    assert_state_dict_round_trip,
)

transformers = pytest.importorskip("transformers")

SPEC = get_family("deepseek_v2")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}
# V2-Lite: q_proj (no query latent), plain top-k, not renormalized, 2 shared experts
LITE = {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "n_shared_experts": 2, "num_hidden_layers": 2}
# V2: the query latent, 8 experts in 4 groups of 2, 2 groups kept, top-3 (3 // 2 = 1: a
# group scores its best expert in both; with top-2 of 2 groups the limit would choose
# nothing), scaled, YaRN
FULL = {"q_lora_rank": 12, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5,
        "n_shared_experts": 1, "num_hidden_layers": 3, "rope_parameters": YARN}
CASES = {"v2-lite": LITE, "v2": FULL}


def hf_tiny_config(**overrides):
    """A tiny DeepseekV2Config: hidden 64, 4 heads of 8 + 4 (values 6), the first layer
    dense, then MoE layers of 8 experts (16 wide) top-2 with shared experts."""
    kw = dict(vocab_size=TINY["vocab_size"], hidden_size=64, intermediate_size=96,
              moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=2, topk_method="greedy", n_group=1, topk_group=1,
              first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False,
              q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=6, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(overrides)
    cfg = transformers.DeepseekV2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def our_config(hf_cfg) -> ModelConfig:
    return parity.our_config(SPEC, hf_cfg)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(case, HF model, our model, our config) holding the same weights."""
    hf, ours, cfg = parity.converted_pair(SPEC, transformers.DeepseekV2ForCausalLM,
                                          hf_tiny_config(**CASES[request.param]))
    return request.param, hf, ours, cfg


def test_flags_of_each_shape():
    lite, full = our_config(hf_tiny_config(**LITE)), our_config(hf_tiny_config(**FULL))
    for cfg in (lite, full):
        assert cfg.moe_router_score_function == "softmax" and cfg.moe_router_pre_softmax
        assert not cfg.moe_router_enable_expert_bias and cfg.mtp_num_layers is None
        assert cfg.multi_latent_attention and cfg.qk_layernorm
    assert lite.q_lora_rank is None and lite.moe_router_num_groups is None
    assert lite.moe_shared_expert_intermediate_size == 32
    assert lite.moe_router_topk_scaling_factor == 1.0 and lite.moe_layer_freq == "[0]*1+[1]*1"
    assert full.q_lora_rank == 12 and full.rotary_scaling_factor == 4.0
    assert (full.moe_router_num_groups, full.moe_router_group_topk) == (4, 2)
    assert full.moe_router_topk_scaling_factor == 2.5 and full.moe_layer_freq == "[0]*1+[1]*2"


def test_family_and_state_dict_round_trip(pair):
    _, hf, ours, cfg = pair
    assert_state_dict_round_trip(SPEC, hf, ours, cfg)


def test_logits_match_transformers(pair):
    assert_logits_match(*pair)


def test_greedy_generation_matches_transformers(pair):
    _, hf, ours, cfg = pair
    assert_greedy_generation_matches(hf, ours, cfg)


@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_transformers_gate(case):
    """Experts and weights of megalite's routing under the converted flags equal
    DeepseekV2TopkRouter's for 512 random tokens; the V2 shape's group limit changes the
    choice of some tokens (it is exercised)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hcfg = hf_tiny_config(**CASES[case])
    cfg = our_config(hcfg)
    gate = DeepseekV2TopkRouter(hcfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        x = torch.randn(512, hcfg.hidden_size, generator=g)
        logits, weights, experts = gate(x)
    probs, idx = topk_probs(logits, cfg.moe_router_topk, cfg.moe_router_score_function,
                            cfg.moe_router_topk_scaling_factor,
                            pre_softmax=cfg.moe_router_pre_softmax,
                            num_groups=cfg.moe_router_num_groups,
                            group_topk=cfg.moe_router_group_topk)
    ours_w, order = idx.sort(-1)
    theirs_w, their_order = experts.sort(-1)
    assert torch.equal(ours_w, theirs_w)
    assert torch.allclose(probs.gather(1, order), weights.gather(1, their_order),
                          rtol=0, atol=1e-7)
    plain = topk_probs(logits, cfg.moe_router_topk, pre_softmax=True)[1].sort(-1).values
    assert torch.equal(plain, theirs_w) == (case == "v2-lite")


def test_config_round_trip():
    for case in CASES.values():
        hcfg = hf_tiny_config(**case)
        back = SPEC.hf_config(our_config(hcfg))
        assert type(back).__name__ == "DeepseekV2Config"
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "n_shared_experts",
                    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                    "topk_method", "norm_topk_prob", "first_k_dense_replace",
                    "routed_scaling_factor", "q_lora_rank", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
                    "tie_word_embeddings"):
            assert getattr(back, key) == getattr(hcfg, key), key
        want_rope = case.get("rope_parameters", {"rope_type": "default"})
        for key, value in want_rope.items():
            assert back.rope_parameters[key] == value, key
    # every group kept: no group limit needed, written back as greedy
    cfg = our_config(hf_tiny_config(topk_method="group_limited_greedy", n_group=2,
                                    topk_group=2))
    assert cfg.moe_router_num_groups is None
    assert SPEC.hf_config(cfg).topk_method == "greedy"


@pytest.mark.parametrize("overrides,match", [
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
      "num_experts_per_tok": 4}, r"num_experts_per_tok 4 // topk_group 2 = 2"),
    ({"norm_topk_prob": True}, r"norm_topk_prob true"),
    ({"topk_method": "noaux_tc"}, r"topk_method 'noaux_tc'"),
    ({"attention_bias": True}, r"attention_bias"),
], ids=["group-sum-of-2", "norm-topk-prob", "topk-method", "attention-bias"])
def test_config_refusals(overrides, match):
    with pytest.raises(ValueError, match="DeepSeek-V2 config megalite cannot represent: .*"
                       + match):
        SPEC.config_from_hf(hf_tiny_config(**overrides))


def test_model_refusals():
    """Exports refuse routings DeepSeek-V2's format cannot hold, with the flag named."""
    cfg = our_config(hf_tiny_config(**FULL))
    for change, match in [({"moe_router_pre_softmax": False}, "no --moe-router-pre-softmax"),
                          ({"moe_router_topk": 4}, "group scores of the best 2 experts"),
                          ({"moe_layer_freq": "[1]*1+[0]*2"}, "dense layers first"),
                          ({"qk_layernorm": False}, "no --qk-layernorm")]:
        with pytest.raises(ValueError, match=match):
            SPEC.hf_config(dataclasses.replace(cfg, **change))
    # DeepSeek-V3's routing is the other family
    v3 = dataclasses.replace(cfg, moe_router_score_function="sigmoid",
                             moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
                             moe_router_num_groups=None, moe_router_group_topk=None)
    assert family_of(v3) is get_family("deepseek_v3")


def test_latent_norm_eps_and_mtp_warnings():
    assert SPEC.conversion_warnings(hf_tiny_config()) == []
    (warning,) = SPEC.conversion_warnings(hf_tiny_config(rms_norm_eps=1e-5))
    assert "latent norms" in warning
    cfg = our_config(hf_tiny_config())
    assert cfg.norm_epsilon == 1e-6 and SPEC.export_warnings(cfg) == []
    eps, mtp = SPEC.export_warnings(dataclasses.replace(cfg, norm_epsilon=1e-5,
                                                        mtp_num_layers=1))
    assert "--norm-epsilon 1e-05" in eps and "DeepSeek-V2" in eps
    assert "multi token prediction" in mtp.replace("-", " ") and "not written" in mtp


# config.json fields of the hub's DeepSeek-V2-Lite and DeepSeek-V2 (sizes as published;
# the legacy ``rope_scaling`` spelling, fields transformers does not read left in)
V2_LITE_HUB = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
               "intermediate_size": 10944, "moe_intermediate_size": 1408,
               "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
               "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
               "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
               "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "rope_theta": 10000, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 163840, "routed_scaling_factor": 1.0,
               "norm_topk_prob": False, "topk_method": "greedy", "n_group": 1,
               "topk_group": 1, "scoring_func": "softmax", "seq_aux": True,
               "aux_loss_alpha": 0.001, "tie_word_embeddings": False,
               "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707,
                                "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                "original_max_position_embeddings": 4096}}
V2_HUB = {**V2_LITE_HUB, "hidden_size": 5120, "intermediate_size": 12288,
          "moe_intermediate_size": 1536, "num_hidden_layers": 60, "num_attention_heads": 128,
          "num_key_value_heads": 128, "n_routed_experts": 160, "q_lora_rank": 1536,
          "routed_scaling_factor": 16.0, "topk_method": "group_limited_greedy",
          "n_group": 8, "topk_group": 3}


def test_hub_configs():
    """V2-Lite's config.json converts (greedy top-6 of 64, two shared experts, YaRN 40);
    V2's top-6 of 3 groups of 8 is refused, naming the fields."""
    lite = ModelConfig(**SPEC.config_from_hf(transformers.DeepseekV2Config(**V2_LITE_HUB)))
    assert (lite.num_layers, lite.num_experts, lite.moe_router_topk) == (27, 64, 6)
    assert lite.moe_router_pre_softmax and lite.moe_router_num_groups is None
    assert lite.moe_shared_expert_intermediate_size == 2816 and lite.q_lora_rank is None
    assert lite.moe_layer_freq == "[0]*1+[1]*26" and lite.kv_lora_rank == 512
    assert (lite.rotary_scaling_factor, lite.mscale, lite.mscale_all_dim) == (40.0, 0.707,
                                                                              0.707)
    assert family_of(lite) is SPEC
    with pytest.raises(ValueError, match=r"num_experts_per_tok 6 // topk_group 3 = 2"):
        SPEC.config_from_hf(transformers.DeepseekV2Config(**V2_HUB))
