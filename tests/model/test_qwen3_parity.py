"""Qwen3 and Qwen3-MoE: tiny random ``transformers`` models converted through their
family specs give the same fp32 logits (within 1e-5) and the same greedy tokens here; the
name mappings round-trip (in-memory and hub-file names); configs translate both ways,
including Qwen3-MoE's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) and
``norm_topk_prob``; what megalite cannot represent is refused."""

import pytest
import torch

from megalite.config import ModelConfig
from megalite.inference.generation import generate
from megalite.models.families import family_for_hf, family_of, get_family
from megalite.models.families.qwen3_moe import layer_freq_expression
from megalite.models.gpt import GPTModel
from tests.model.common import single_process_state

TOL = 1e-5
VOCAB = 61
PROMPT = [9, 22, 4, 31, 40, 2]  # one whose greedy continuation varies in every case
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=32, rms_norm_eps=1e-6,
              initializer_range=0.2)  # O(1) activations: a mapping slip shows
# name -> (model_type, HF config kwargs)
CASES = {
    # head_dim 16 != hidden / heads (as Qwen3-0.6B's 128 with hidden 1024, 16 heads)
    "qwen3": ("qwen3", dict(num_hidden_layers=2, head_dim=16, tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    # layer 0 dense, layers 1-3 sparse; renormalized top-k (Qwen3-30B-A3B's setting)
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, moe_intermediate_size=16,
                                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    mlp_only_layers=[0], tie_word_embeddings=False)),
    # every second layer sparse; top-k weights not renormalized
    "qwen3_moe-step2": ("qwen3_moe", dict(num_hidden_layers=2, moe_intermediate_size=16,
                                          num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=False, decoder_sparse_step=2,
                                          tie_word_embeddings=False)),
}


def hf_model(case: str, vocab_size: int = VOCAB):
    """A tiny random ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` in fp32, eager
    attention, with norm weights moved off one (so a norm mapping slip shows)."""
    import transformers

    model_type, kwargs = CASES[case]
    spec = family_for_hf(model_type)
    cfg_cls = getattr(transformers, spec.hf_architecture.replace("ForCausalLM", "Config"))
    hcfg = cfg_cls(**{**COMMON, "vocab_size": vocab_size, **kwargs})
    hcfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, spec.hf_architecture)(hcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif "gate.weight" in name:  # routers: spread the scores over the experts
                p.normal_(0, 0.5)
    return model


def converted(model):
    """(spec, our config, our model) of a transformers model, through the spec alone."""
    spec = family_for_hf(model.config.model_type)
    cfg = ModelConfig(**{**spec.config_from_hf(model.config), "seq_length": 32,
                         "make_vocab_size_divisible_by": 8, "hidden_dropout": 0.0,
                         "attention_dropout": 0.0, "attention_backend": "sdpa"})
    ours = GPTModel(cfg, single_process_state(), seed=1).eval()
    ours.load_full_state_dict(spec.from_hf(model.state_dict(), cfg))
    return spec, cfg, ours


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    model = hf_model(request.param)
    return (request.param, model, *converted(model))


def test_family_of_the_converted_config(pair):
    case, _, spec, cfg, _ = pair
    assert spec.name == CASES[case][0] and family_of(cfg) is spec
    assert cfg.qk_layernorm and not cfg.add_bias_linear and not cfg.add_qkv_bias
    assert cfg.untie_embeddings_and_output_weights == (case != "qwen3-tied")


def test_logits_match_transformers(pair):
    _, hf, _, cfg, ours = pair
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)[..., :VOCAB]
    assert want.dtype == got.dtype == torch.float32
    assert (got - want).abs().max().item() < TOL


def test_greedy_generation_matches_transformers(pair):
    _, hf, _, _, ours = pair
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    got = generate(ours, PROMPT, 12)
    assert got == want and len(set(got)) > 1


def test_state_dict_round_trips(pair):
    _, hf, spec, cfg, ours = pair
    mine = ours.full_state_dict()
    hf_state = spec.to_hf(mine, cfg)
    want = hf.state_dict()
    assert sorted(hf_state) == sorted(want)
    assert all(torch.equal(hf_state[k], want[k]) for k in want)
    hub = spec.to_hub_names(hf_state, cfg)
    back = spec.from_hf(hub, cfg)
    assert sorted(back) == sorted(mine) and all(torch.equal(back[k], mine[k]) for k in mine)


def test_hub_names_are_what_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file

    hf = hf_model("qwen3_moe")
    hf.save_pretrained(str(tmp_path))
    files = load_file(str(tmp_path / "model.safetensors"))
    spec, cfg, ours = converted(hf)
    hub = spec.to_hub_names(spec.to_hf(ours.full_state_dict(), cfg), cfg)
    assert sorted(hub) == sorted(files)
    assert all(torch.equal(hub[k], files[k]) for k in files)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in files
    assert "model.layers.0.mlp.gate_proj.weight" in files  # the dense layer


def test_configs_translate_both_ways(pair):
    case, hf, spec, cfg, _ = pair
    again = spec.hf_config(cfg)
    assert family_for_hf(again.model_type) is spec
    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                 "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                 "tie_word_embeddings", "vocab_size", "moe_intermediate_size", "num_experts",
                 "num_experts_per_tok", "norm_topk_prob"):
        assert getattr(again, name, None) == getattr(hf.config, name, None), name
    assert again.rope_parameters["rope_theta"] == hf.config.rope_parameters["rope_theta"]
    if spec.name == "qwen3_moe":
        from megalite.models.families.qwen3_moe import hf_moe_pattern

        assert hf_moe_pattern(again) == hf_moe_pattern(hf.config) == list(cfg.moe_layer_pattern)
        assert cfg.moe_router_pre_softmax == (not hf.config.norm_topk_prob)


def test_layer_freq_expression():
    assert layer_freq_expression([True] * 4) == 1
    assert layer_freq_expression([False, True, True]) == "[0]*1+[1]*2"
    assert converted(hf_model("qwen3_moe"))[1].moe_layer_freq == "[0]*1+[1]*3"
    assert layer_freq_expression([False, True, False, True]) == "[0]*1+[1]*1+[0]*1+[1]*1"


def test_refusals():
    from transformers import Qwen3Config, Qwen3MoeConfig

    qwen3, moe = get_family("qwen3"), get_family("qwen3_moe")
    with pytest.raises(ValueError, match="sliding-window attention"):
        qwen3.config_from_hf(Qwen3Config(**COMMON, num_hidden_layers=2,
                                         use_sliding_window=True, sliding_window=8))
    with pytest.raises(ValueError, match="attention_bias"):
        qwen3.config_from_hf(Qwen3Config(**COMMON, num_hidden_layers=2, attention_bias=True))
    with pytest.raises(ValueError, match="no layer has experts"):
        moe.config_from_hf(Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_experts=4,
                                          mlp_only_layers=[0, 1]))
    cfg = ModelConfig(**{**moe.defaults, "num_layers": 2, "hidden_size": 32,
                         "num_attention_heads": 4, "ffn_hidden_size": 48})
    assert family_of(cfg) is moe
    with pytest.raises(ValueError, match="moe-router-score-function sigmoid"):
        moe.hf_config(ModelConfig(**{**cfg.__dict__, "moe_router_score_function": "sigmoid"}))
    no_norm = ModelConfig(**{**qwen3.defaults, "qk_layernorm": False})
    assert family_of(no_norm) is get_family("llama")
    with pytest.raises(ValueError, match="no --qk-layernorm"):
        qwen3.check(no_norm)
