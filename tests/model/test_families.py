"""The model-family registry: lookups by name, by ``transformers`` model type and by model
configuration; errors that name what is known; registering a new spec."""

import pytest

from megalite.config import ModelConfig
from megalite.models.families import (
    BUILTIN,
    FamilyRegistry,
    family_for_hf,
    family_names,
    family_of,
    get_family,
)
from megalite.models.families.llama import LlamaSpec
from tests.model.common import deepseek_v3_config, gpt2_config, llama_config, mixtral_config

TINY = {"gpt2": gpt2_config, "llama": llama_config, "mixtral": mixtral_config,
        "deepseek_v3": deepseek_v3_config}


def test_builtin_families():
    import transformers

    assert family_names() == ("gpt2", "llama", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3",
                              "deepseek_v2")
    for name in family_names():
        spec = get_family(name)
        assert spec.name == name and family_for_hf(spec.hf_model_type) is spec
        assert hasattr(transformers, spec.hf_architecture)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="'qwen2'.*gpt2.*llama.*mixtral"):
        get_family("qwen2")
    with pytest.raises(ValueError, match="'qwen2' is not supported.*gpt2, llama, mixtral"):
        family_for_hf("qwen2")


@pytest.mark.parametrize("name", list(TINY))
def test_family_of_tiny_configs(name):
    assert family_of(TINY[name]()) is get_family(name)


@pytest.mark.parametrize("name", family_names())
def test_defaults_make_a_model_of_the_family(name):
    assert family_of(ModelConfig(**get_family(name).defaults)) is get_family(name)


def test_family_of_names_every_reason():
    with pytest.raises(ValueError, match="mixtral: .*--moe-layer-freq 2") as info:
        family_of(mixtral_config(moe_layer_freq=2))
    assert "llama: experts" in str(info.value) and "gpt2: " in str(info.value)
    with pytest.raises(ValueError, match="no Hugging Face family"):
        family_of(llama_config(rotary_percent=0.5))
    with pytest.raises(ValueError, match="no Hugging Face family"):
        family_of(gpt2_config(position_embedding_type="none"))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_config_round_trips_through_transformers(name):
    spec, cfg = get_family(name), TINY[name]()
    again = ModelConfig(**{**spec.config_from_hf(spec.hf_config(cfg)),
                           "seq_length": cfg.seq_length})
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "normalization", "swiglu",
                  "position_embedding_type", "add_bias_linear",
                  "untie_embeddings_and_output_weights", "norm_epsilon"):
        assert getattr(again, field) == getattr(cfg, field), field


def test_gpt2_tanh_gelu_warns():
    from transformers import GPT2Config

    spec = get_family("gpt2")
    assert spec.conversion_warnings(GPT2Config(activation_function="gelu")) == []
    (warning,) = spec.conversion_warnings(GPT2Config(activation_function="gelu_new"))
    assert "gelu_new" in warning


class _QKVBiasLlama(LlamaSpec):
    """A stand-in new family: Llama with q/k/v biases only (as Qwen2)."""

    name = "qkv-bias-llama"
    hf_model_type = "qkv_bias_llama"
    defaults = {**LlamaSpec.defaults, "add_qkv_bias": True}

    def problems(self, model_cfg):
        return super().problems(model_cfg) + ([] if model_cfg.add_qkv_bias else ["no qkv bias"])


def test_registering_a_new_family():
    registry = FamilyRegistry((_QKVBiasLlama(), *BUILTIN))
    spec = registry.get("qkv-bias-llama")
    assert registry.for_hf("qkv_bias_llama") is spec
    assert registry.family_of(llama_config(add_qkv_bias=True)) is spec
    assert registry.family_of(llama_config()) is get_family("llama")  # the order decides
    assert get_family("llama") is not spec and "qkv-bias-llama" not in family_names()
    with pytest.raises(ValueError, match="clashes"):
        registry.register(_QKVBiasLlama())
