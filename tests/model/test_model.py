"""GPTModel interface, init, backends, dtypes and configuration errors."""

import math

import pytest
import torch

from megalite.config import ConfigError, MegaliteConfig, ModelConfig, ParallelConfig
from megalite.models.gpt import GPTModel
from megalite.parallel.params import param_meta
from tests.model.common import FAMILIES, batch, gpt2_config, llama_config, single_process_state



@pytest.mark.parametrize("family", list(FAMILIES))
def test_interface_shapes_and_param_attributes(family):
    cfg = FAMILIES[family]()
    model = GPTModel(cfg, single_process_state(), sequence_parallel=False, seed=1,
                     pre_process=True, post_process=True)
    ids, labels = batch(cfg)
    loss = model(ids, labels=labels)
    assert loss.shape == ids.shape and loss.dtype == torch.float32
    assert loss[0, 3] == 0.0  # ignored label
    logits = model(ids, position_ids=torch.arange(cfg.seq_length).expand_as(ids))
    assert logits.shape == (*ids.shape, cfg.padded_vocab_size(1))
    assert torch.allclose(logits, model(ids))
    for name, p in model.named_parameters():  # every parameter described, and drawn once
        meta = param_meta(p)
        assert meta.initialized and (meta.init_std is None) != (meta.init_fill is None), name
    word = param_meta(model.embedding.word_embeddings.weight)
    assert word.shared_embedding == (family == "gpt2") and word.partition_dim == 0


def test_init_is_named_scaled_and_stage_independent():
    cfg = llama_config(num_layers=4, hidden_size=128, ffn_hidden_size=256)
    ps = single_process_state()
    full = GPTModel(cfg, ps, seed=3).full_state_dict()
    std = full["decoder.layers.0.mlp.linear_fc2.weight"].std().item()
    assert math.isclose(std, 0.02 / math.sqrt(8), rel_tol=0.05)
    assert math.isclose(full["decoder.layers.0.mlp.linear_fc1.weight"].std().item(), 0.02,
                        rel_tol=0.05)
    assert not torch.equal(full["decoder.layers.0.mlp.linear_fc1.weight"],
                           full["decoder.layers.1.mlp.linear_fc1.weight"])
    stage = GPTModel(cfg, ps, seed=3, pre_process=False, post_process=True, first_layer=2,
                     num_layers=2).full_state_dict()
    assert sorted(stage) == sorted(k for k in full if not k.startswith("embedding")
                                   and ".layers.0." not in k and ".layers.1." not in k)
    assert all(torch.equal(stage[k], full[k]) for k in stage)


def test_pipeline_stages_compose_to_full_model():
    cfg = gpt2_config()
    ps = single_process_state()
    ids, labels = batch(cfg)
    full = GPTModel(cfg, ps, seed=2)
    first = GPTModel(cfg, ps, seed=2, post_process=False, num_layers=1)
    last = GPTModel(cfg, ps, seed=2, pre_process=False, first_layer=1)
    # tied output weight on the last stage starts equal to the first stage's embedding
    assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
    assert param_meta(last.output_layer.weight).shared_embedding
    hidden = first(ids)
    assert hidden.shape == (cfg.seq_length, ids.shape[0], cfg.hidden_size)
    assert torch.allclose(last(hidden_states=hidden, labels=labels), full(ids, labels=labels))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_backends_agree(family):
    ps = single_process_state()
    ids, _ = batch(FAMILIES[family]())
    out = {}
    for backend in ("local", "sdpa", "auto"):
        model = GPTModel(FAMILIES[family](attention_backend=backend), ps, seed=4).eval()
        with torch.no_grad():
            out[backend] = model(ids)
    assert torch.allclose(out["local"], out["sdpa"], atol=1e-5)
    assert torch.equal(out["auto"], out["sdpa"])  # no flash-attn on CPU


def test_flash_backend_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="flash"):
        GPTModel(gpt2_config(attention_backend="flash"), single_process_state())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_params_fp32_loss(family):
    cfg = FAMILIES[family](bf16=True)
    model = GPTModel(cfg, single_process_state(), seed=1)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, labels = batch(cfg)
    loss = model(ids, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
    assert model.embedding.word_embeddings.weight.grad.dtype == torch.bfloat16
    assert model(ids).dtype == torch.bfloat16
    ref = GPTModel(FAMILIES[family](), single_process_state(), seed=1)
    assert abs(ref(ids, labels=labels).mean().item() - loss.mean().item()) < 2e-2


def _validate(tp, sp=False, **model):
    cfg = MegaliteConfig(model=ModelConfig(**model),
                         parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                 sequence_parallel=sp))
    return cfg.validate(world_size=tp)


@pytest.mark.parametrize("model, sp, match", [
    ({"num_attention_heads": 6, "hidden_size": 48}, False, "num_attention_heads"),
    ({"num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2}, False,
     "num_query_groups"),
    ({"ffn_hidden_size": 90}, False, "ffn_hidden_size"),
    ({"seq_length": 30}, True, "seq_length"),
])
def test_layouts_that_do_not_divide_fail_at_config_time(model, sp, match):
    with pytest.raises(ConfigError, match=match):
        _validate(4, sp, **model)
    _validate(1, False, **model)  # the same model is fine without tensor parallelism


def test_unknown_normalization_fails_when_building():
    with pytest.raises(ConfigError, match="normalization"):
        GPTModel(gpt2_config(normalization="BatchNorm"), single_process_state())


def test_unknown_normalization_fails_in_model_config():
    with pytest.raises(ConfigError, match="normalization"):
        ModelConfig(normalization="BatchNorm")
