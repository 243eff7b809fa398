"""DeepSeek-V3: a tiny random ``DeepseekV3ForCausalLM`` (one dense layer, then MoE with 8
experts in 4 groups, group-limited sigmoid routing with a random correction bias, one
shared expert; with and without the query latent; YaRN and plain RoPE) converted by the
family spec gives transformers' logits within 1e-5 in fp32 and its greedy tokens; the
name mapping round-trips in both the in-memory and the hub-file naming; the configs
translate both ways; MTP layers are named for dropping."""

import dataclasses

import pytest
import torch

from megalite.config import ModelConfig
from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from tests.model.common import TINY, single_process_state
from tests.model import deepseek_parity as parity
from tests.model.deepseek_parity import (
    TOL,
    assert_greedy_generation_matches,
    assert_logits_match,
    assert_state_dict_round_trip,
    randomize,
)

transformers = pytest.importorskip("transformers")

SPEC = get_family("deepseek_v3")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0}
CASES = {"q-lora-yarn": {"q_lora_rank": 12, "rope_parameters": YARN},
         "no-q-lora-rope": {"q_lora_rank": None}}


def hf_tiny_config(**overrides):
    """A tiny DeepseekV3Config: 2 layers (first dense), 8 experts top-4 in 4 groups of 2,
    2 groups per token, one shared expert, MLA with latents 12 / 16, heads 8 + 4 / 6."""
    kw = dict(vocab_size=TINY["vocab_size"], hidden_size=32, intermediate_size=48,
              moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=12,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
              max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              num_nextn_predict_layers=0)   # transformers' models hold no MTP modules
    kw.update(overrides)
    cfg = transformers.DeepseekV3Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def our_config(hf_cfg) -> ModelConfig:
    return parity.our_config(SPEC, hf_cfg)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(case, HF model, our model, our config) holding the same weights."""
    hf, ours, cfg = parity.converted_pair(SPEC, transformers.DeepseekV3ForCausalLM,
                                          hf_tiny_config(**CASES[request.param]))
    return request.param, hf, ours, cfg


def test_family_and_state_dict_round_trip(pair):
    _, hf, ours, cfg = pair
    assert_state_dict_round_trip(SPEC, hf, ours, cfg)


def test_logits_match_transformers(pair):
    assert_logits_match(*pair)


def test_greedy_generation_matches_transformers(pair):
    _, hf, ours, cfg = pair
    assert_greedy_generation_matches(hf, ours, cfg)


def test_config_round_trip_and_refusals():
    hcfg = hf_tiny_config(rope_parameters=YARN)
    cfg = our_config(hcfg)
    assert cfg.moe_layer_freq == "[0]*1+[1]*1" and list(cfg.moe_layer_pattern) == [0, 1]
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert cfg.moe_shared_expert_intermediate_size == 16 and cfg.rotary_scaling_factor == 4.0
    back = SPEC.hf_config(cfg)
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "n_shared_experts",
                "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                "first_k_dense_replace", "routed_scaling_factor", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(back, key) == getattr(hcfg, key), key
    for key in ("rope_type", "factor", "mscale", "mscale_all_dim",
                "original_max_position_embeddings"):
        assert back.rope_parameters[key] == YARN[key], key
    assert back.num_nextn_predict_layers == 0
    with pytest.raises(ValueError, match="topk_group 1 is not 2"):   # Kimi-K2's 8 // 1
        SPEC.config_from_hf(hf_tiny_config(topk_group=1))
    with pytest.raises(ValueError, match="rope_interleave"):
        SPEC.config_from_hf(hf_tiny_config(rope_interleave=False))
    with pytest.raises(ValueError, match="dense layers first"):
        SPEC.hf_config(dataclasses.replace(cfg, moe_layer_freq="[1]*1+[0]*1"))
    with pytest.raises(ValueError, match="no --qk-layernorm"):
        SPEC.to_hf({}, dataclasses.replace(cfg, qk_layernorm=False))
    # all groups kept: no group-limited routing needed
    plain = our_config(hf_tiny_config(n_group=1, topk_group=1))
    assert plain.moe_router_num_groups is None


def test_mtp_layers_past_the_depths_are_named_for_dropping():
    cfg = our_config(hf_tiny_config())
    state = {"model.layers.1.mlp.gate.weight": torch.zeros(1),
             "model.layers.2.eh_proj.weight": torch.zeros(1),
             "model.layers.2.self_attn.q_a_proj.weight": torch.zeros(1),
             "model.norm.weight": torch.zeros(1)}
    dropped, why = SPEC.dropped_hf_tensors(state, cfg)
    assert dropped == ["model.layers.2.eh_proj.weight",
                       "model.layers.2.self_attn.q_a_proj.weight"]
    assert "MTP" in why and "[2]" in why
    assert get_family("llama").dropped_hf_tensors(state, cfg) == ([], "")
    one = dataclasses.replace(cfg, mtp_num_layers=1)   # layer 2 is its depth: kept
    assert SPEC.dropped_hf_tensors(state, one) == ([], "")
    # config.json promising a depth the weights lack (transformers' save_pretrained)
    assert SPEC.fit_to_weights(one, state) == (one, "")
    fitted, note = SPEC.fit_to_weights(one, {"model.norm.weight": torch.zeros(1)})
    assert fitted.mtp_num_layers is None and "num_nextn_predict_layers 1" in note


def test_latent_norm_eps_warnings():
    """transformers' q/kv latent norms always use eps 1e-6: other epsilons warn."""
    assert SPEC.conversion_warnings(hf_tiny_config()) == []
    (warning,) = SPEC.conversion_warnings(hf_tiny_config(rms_norm_eps=1e-5))
    assert "latent norms" in warning
    cfg = our_config(hf_tiny_config())
    assert cfg.norm_epsilon == 1e-6 and SPEC.export_warnings(cfg) == []
    (warning,) = SPEC.export_warnings(dataclasses.replace(cfg, norm_epsilon=1e-5))
    assert "--norm-epsilon 1e-05" in warning


def _hf_with_mtp_layer(seed=0):
    """(HF model of 2 layers, a hub-style state dict: its tensors plus one MTP module as
    layer 2: transformers' own layer-2 tensors of a 3-layer model, enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embedding and head)."""
    torch.manual_seed(seed)
    hf = randomize(transformers.DeepseekV3ForCausalLM(hf_tiny_config()).eval())
    deeper = randomize(transformers.DeepseekV3ForCausalLM(
        hf_tiny_config(num_hidden_layers=3)), seed=4)
    state = dict(hf.state_dict())
    state.update({k: v for k, v in deeper.state_dict().items()
                  if k.startswith("model.layers.2.")})
    g = torch.Generator().manual_seed(5)
    h = 32
    state.update({"model.layers.2.enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                  "model.layers.2.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                  "model.layers.2.eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                  "model.layers.2.shared_head.norm.weight": 1 + 0.2 * torch.randn(h,
                                                                                  generator=g),
                  "model.layers.2.embed_tokens.weight": state["model.embed_tokens.weight"],
                  "model.layers.2.shared_head.head.weight": state["lm_head.weight"]})
    return hf, state


def test_mtp_module_round_trips_and_leaves_the_logits_alone():
    """num_nextn_predict_layers 1 <-> --mtp-num-layers 1: the hub's MTP module (layer 2,
    named as transformers names a decoder layer) loads into mtp.layers.0 and is written
    back bit for bit; the main logits still equal transformers'; a depth head that differs
    from the main one is refused."""
    hf, state = _hf_with_mtp_layer()
    cfg = our_config(hf_tiny_config(num_nextn_predict_layers=1))
    assert cfg.mtp_num_layers == 1
    assert SPEC.hf_config(cfg).num_nextn_predict_layers == 1
    assert SPEC.dropped_hf_tensors(state, cfg) == ([], "")
    ours = GPTModel(cfg, single_process_state(), seed=1).eval()
    full = SPEC.from_hf(state, cfg)
    ours.load_full_state_dict(full)
    assert torch.equal(full["mtp.layers.0.eh_proj.weight"], state["model.layers.2.eh_proj.weight"])
    assert torch.equal(full["mtp.layers.0.final_layernorm.weight"],
                       state["model.layers.2.shared_head.norm.weight"])
    assert torch.equal(full["mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj"
                            ".weight"], state["model.layers.2.self_attn.kv_b_proj.weight"])
    assert ours.mtp.layers[0].transformer_layer.is_moe   # layer 2 is an MoE layer in HF too
    back = SPEC.to_hf(ours.full_state_dict(), cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)[..., :cfg.vocab_size]
    assert (got - want).abs().max().item() < TOL
    other = dict(state, **{"model.layers.2.shared_head.head.weight":
                           state["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="shared_head.head.weight differs"):
        SPEC.from_hf(other, cfg)
