"""The resolved layout (``megalite.config.layout``) and the shapes it derives from the
model config (``megalite.config.shapes``), against what megalite really builds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError, MegaliteConfig, ParallelConfig
from megalite.config import shapes
from megalite.models.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.pipeline.schedules import build_schedules, layout_schedules
from tests.model.common import gpt2_config, llama_config, mixtral_config


def _model_params(model_cfg) -> tuple[dict, int]:
    """(name -> shape of every parameter, transformer-layer elements) of a one-process
    GPTModel (layers and final norm: no embedding, no output layer)."""
    model = GPTModel(model_cfg, ParallelState.build(ParallelConfig()))
    named = dict(model.named_parameters())
    layers = sum(p.numel() for n, p in named.items()
                 if "embedding" not in n and "output_layer" not in n)
    return {n: tuple(p.shape) for n, p in named.items()}, layers


def _mla(**overrides):
    from tests.layouts import MLA

    return llama_config(**{**MLA, **overrides})


@pytest.mark.parametrize("make", [
    gpt2_config, llama_config, mixtral_config, _mla,
    lambda: _mla(q_lora_rank=None, qk_layernorm=False),
    lambda: gpt2_config(qk_layernorm=True)],
    ids=["gpt2", "llama", "mixtral", "mla", "mla-no-q-lora", "qk-norm"])
def test_parameter_counts_match_the_built_model(make):
    m = make()
    _, built = _model_params(m)
    counted = sum(sum(shapes.layer_params(m, i)) for i in range(m.num_layers))
    assert counted + shapes.norm_params(m) == built
    if m.num_experts is None:
        assert shapes.active_layer_params(m) == built
    else:   # a token passes through top-k of the experts
        per_expert = sum(shapes.layer_params(m, 0)[1:]) // m.num_experts
        assert shapes.active_layer_params(m) == built - m.num_layers * per_expert * (
            m.num_experts - m.moe_router_topk)


def test_flops_per_token_is_six_n_plus_output_layer_plus_attention():
    m = llama_config()
    _, n = _model_params(m)
    v = m.padded_vocab_size(1)
    assert shapes.flops_per_token(m, v) == 6 * n + 6 * m.hidden_size * v \
        + 12 * m.num_layers * m.hidden_size * m.seq_length


def test_mla_flops_count_its_projections_and_head_dims():
    """Multi-latent attention: 6 N of its own (larger) parameters, and scores of width
    qk_head_dim + qk_pos_emb_head_dim and values of v_head_dim per head, not 12 L h s."""
    m = _mla()
    _, n = _model_params(m)
    v = m.padded_vocab_size(1)
    attention = 6 * m.num_layers * m.seq_length * m.num_attention_heads * (12 + 6)
    assert shapes.flops_per_token(m, v) == 6 * n + 6 * m.hidden_size * v + attention
    assert attention != 12 * m.num_layers * m.hidden_size * m.seq_length


def test_mla_gemm_shapes_are_its_projections():
    m = _mla()
    lay = MegaliteConfig(model=m).resolve(1)
    named, _ = _model_params(m)
    tokens = lay.tokens_per_microbatch
    names = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
             "linear_kv_up_proj", "linear_proj")
    weights = [named[f"decoder.layers.0.self_attention.{name}.weight"] for name in names]
    weights += [named[f"decoder.layers.0.mlp.{n}.weight"] for n in ("linear_fc1", "linear_fc2")]
    assert [(n, k, o) for n, k, o, _ in lay.gemms[:-1]] == [(tokens, k, o) for o, k in weights]


def test_gemm_shapes_are_the_linear_layers_weights():
    m = llama_config()
    cfg = MegaliteConfig(model=m)
    lay = cfg.resolve(1)
    named, _ = _model_params(m)
    tokens = lay.tokens_per_microbatch
    weights = [named[f"decoder.layers.0.{name}.weight"] for name in
               ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                "mlp.linear_fc2")] + [named["output_layer.weight"]]
    assert [(n, k, o) for n, k, o, _ in lay.gemms] == [(tokens, k, o) for o, k in weights]
    assert [c for *_, c in lay.gemms] == [m.num_layers] * 4 + [1]


def test_a_pipelined_expert_layout_resolves_once():
    cfg = parse_args([
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
        "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
        "--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "2",
        "--global-batch-size", "32", "--bf16", "--use-distributed-optimizer",
        "--train-iters", "1"])
    lay = cfg.resolve(16)
    assert (lay.tp, lay.cp, lay.pp, lay.vpp, lay.dp) == (2, 1, 2, 2, 4)
    assert (lay.ep, lay.etp, lay.edp) == (4, 1, 2)
    assert lay.num_microbatches == 32 // (2 * 4) == 4
    assert lay.stage_chunks == (((0, 2), (4, 2)), ((2, 2), (6, 2)))
    assert lay.stage_layers(1) == [2, 3, 6, 7]
    assert lay.padded_vocab_size == 256 and lay.dtype == torch.bfloat16
    assert lay.dtype_bytes == 2 and lay.sp == 2 and lay.strategy == "optim"
    assert layout_schedules(lay) == build_schedules(2, 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.dp = 2


def test_micro_batches_follow_the_batch_size_schedule():
    cfg = parse_args(["--seq-length", "16", "--train-iters", "4", "--micro-batch-size", "2",
                      "--step-batch-size-schedule", "0:8 256:16 512:32"])
    lay = cfg.resolve(2)
    assert lay.global_batch_size == 32 and lay.num_microbatches == 8
    assert lay.microbatch_steps() == [(0, 2), (16, 4), (32, 8)]
    assert [lay.microbatches_at(c) for c in (0, 15, 16, 31, 32, 10_000)] == [2, 2, 4, 4, 8, 8]


def test_without_a_vocabulary_the_vocabulary_terms_wait():
    cfg = MegaliteConfig()
    cfg.model.vocab_size = None
    lay = cfg.resolve(1)
    assert lay.padded_vocab_size is None and lay.flops_per_token is None
    cfg.model.vocab_size = 1000
    assert lay.with_vocab(cfg.model).padded_vocab_size == 1024


def test_a_layout_that_does_not_divide_is_refused_with_the_sizes():
    with pytest.raises(ConfigError, match=r"world size \(6\) must be divisible by "
                                          r"tensor_model_parallel_size \(4\)"):
        MegaliteConfig(parallel=ParallelConfig(tensor_model_parallel_size=4)).resolve(6)
