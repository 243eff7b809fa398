"""Config validation: one clear error per problem."""

import pytest

from megalite.config import (
    ConfigError,
    MegaliteConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)


def make(world=1, model=None, parallel=None, train=None):
    cfg = MegaliteConfig(model=ModelConfig(**(model or {})),
                         parallel=ParallelConfig(**(parallel or {})),
                         train=TrainConfig(**(train or {})))
    return cfg.validate(world)


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(model=dict(num_attention_heads=12, hidden_size=48),
          parallel=dict(tensor_model_parallel_size=5)), 10,
     r"num_attention_heads \(12\) must be divisible by tensor_model_parallel_size \(5\)"),
    (dict(parallel=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)), 6,
     r"world size \(6\) must be divisible by tensor_model_parallel_size \(2\) x "
     r"pipeline_model_parallel_size \(2\) x context_parallel_size \(1\) = 4"),
    (dict(train=dict(micro_batch_size=2, global_batch_size=6)), 2,
     r"global_batch_size \(6\) must be divisible by micro_batch_size \(2\) x data parallel "
     r"size \(2\)"),
    (dict(model=dict(num_attention_heads=8, group_query_attention=True, num_query_groups=2),
          parallel=dict(tensor_model_parallel_size=4)), 4,
     r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)"),
    (dict(model=dict(ffn_hidden_size=66), parallel=dict(tensor_model_parallel_size=4)), 4,
     r"ffn_hidden_size \(66\) must be divisible"),
    (dict(model=dict(seq_length=30), parallel=dict(tensor_model_parallel_size=4,
                                                   sequence_parallel=True)), 4,
     r"seq_length \(30\) must be divisible by tensor_model_parallel_size \(4\)"),
    (dict(model=dict(num_layers=3), parallel=dict(pipeline_model_parallel_size=2)), 2,
     r"num_layers \(3\) must be divisible by pipeline_model_parallel_size \(2\)"),
    (dict(model=dict(num_layers=4), parallel=dict(pipeline_model_parallel_size=2,
                                                  virtual_pipeline_model_parallel_size=3)), 2,
     r"num_layers \(4\) must be divisible by pipeline_model_parallel_size \(2\) x virtual"),
    (dict(model=dict(num_experts=6), parallel=dict(expert_model_parallel_size=4)), 4,
     r"num_experts \(6\) must be divisible by expert_model_parallel_size \(4\)"),
    (dict(parallel=dict(expert_model_parallel_size=2)), 2, r"need --num-experts"),
    # found by the layout fuzzer (seed 1001): middle stages left without a layer
    (dict(model=dict(num_layers=2), parallel=dict(pipeline_model_parallel_size=4,
                                                  decoder_first_pipeline_num_layers=1,
                                                  decoder_last_pipeline_num_layers=1)), 4,
     r"leave 0 of num_layers \(2\) for 2 middle stages: every pipeline stage needs at "
     r"least one layer"),
])
def test_cross_section_errors(kwargs, world, message):
    with pytest.raises(ConfigError, match=message):
        make(world, **kwargs)


@pytest.mark.parametrize("cls, kwargs, message", [
    (ModelConfig, dict(hidden_size=50, num_attention_heads=4), r"hidden_size \(50\)"),
    (ModelConfig, dict(num_experts=2, moe_router_topk=3), r"moe_router_topk \(3\) must be <="),
    (ModelConfig, dict(bf16=True, fp16=True), "cannot both"),
    (ModelConfig, dict(num_layers=0), "num_layers must be positive"),
    (ModelConfig, dict(group_query_attention=True), "needs --num-query-groups"),
    (ModelConfig, dict(recompute_method="uniform"), "needs --recompute-granularity full"),
    (ParallelConfig, dict(overlap_param_gather=True), "needs --use-distributed-optimizer"),
    (ParallelConfig, dict(ddp_bucket_size=0), r"--ddp-bucket-size must be > 0"),
    (ParallelConfig, dict(virtual_pipeline_model_parallel_size=2), "pipeline-model-parallel"),
    (OptimConfig, dict(lr=1e-4, min_lr=1e-3), r"min_lr \(0.001\) must not exceed lr"),
    (OptimConfig, dict(lr_warmup_iters=5, lr_warmup_fraction=0.1), "not both"),
])
def test_section_errors(cls, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        cls(**kwargs)


def test_defaults_are_filled():
    cfg = make(4, model=dict(hidden_size=64, num_layers=4),
               parallel=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             num_layers_per_virtual_pipeline_stage=1),
               train=dict(micro_batch_size=2, global_batch_size=4))
    assert cfg.model.ffn_hidden_size == 256 and cfg.model.kv_channels == 16
    assert make(8, parallel=dict(tensor_model_parallel_size=2),
                train=dict(micro_batch_size=2)).train.global_batch_size == 8  # 2 x dp 4
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert cfg.parallel.expert_tensor_parallel_size == 2


def test_padded_vocab():
    m = ModelConfig(vocab_size=50257, make_vocab_size_divisible_by=128)
    assert m.padded_vocab_size(1) == 50304
    assert m.padded_vocab_size(4) == 50688
    assert m.padded_vocab_size(4) % (128 * 4) == 0


def test_round_trip_dict():
    cfg = make(1, model=dict(num_layers=3))
    again = MegaliteConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_a_config_from_another_version_names_what_it_lacks():
    saved = make(1).to_dict()
    saved["model"]["rotary_wobble"] = 2
    saved["telemetry"] = {}
    with pytest.raises(ConfigError, match=r"does not know: telemetry, model.rotary_wobble "
                                          r"\(written by another megalite version\?\)"):
        MegaliteConfig.from_dict(saved)


def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(ConfigError, match=r"number of micro-batches \(6 = global_batch_size "
                                          r"6 / \(micro_batch_size 1 x data parallel 1\)\) "
                                          r"to be a multiple of pipeline_model_parallel_size "
                                          r"\(4\)"):
        make(4, model=dict(num_layers=8),
             parallel=dict(pipeline_model_parallel_size=4,
                           virtual_pipeline_model_parallel_size=2),
             train=dict(global_batch_size=6))


MOE = dict(num_experts=4, moe_router_topk=2)


@pytest.mark.parametrize("model, parallel, world, message", [
    # MoE layers split the sequence over tp even without sequence parallelism
    (dict(seq_length=30), dict(tensor_model_parallel_size=4), 4,
     r"seq_length \(30\) must be divisible by tensor_model_parallel_size \(4\) x "
     r"context_parallel_size \(1\) with --num-experts"),
    (dict(moe_ffn_hidden_size=6), dict(tensor_model_parallel_size=4), 4,
     r"moe_ffn_hidden_size \(6\) must be divisible by expert_tensor_parallel_size \(4\)"),
    (dict(), dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=2), 4,
     r"expert biases need expert_tensor_parallel_size \(2\) equal to 1 or to "
     r"tensor_model_parallel_size \(4\)"),
    (dict(moe_shared_expert_intermediate_size=6), dict(tensor_model_parallel_size=4), 4,
     r"moe_shared_expert_intermediate_size \(6\) must be divisible by "
     r"tensor_model_parallel_size \(4\)"),
    (dict(moe_token_dispatcher_type="allgather"), dict(variable_seq_lengths=True), 1,
     r"allgather .* cannot be used with --variable-seq-lengths"),
])
def test_moe_layout_errors(model, parallel, world, message):
    with pytest.raises(ConfigError, match=message):
        make(world, model={**MOE, **model}, parallel=parallel)


@pytest.mark.parametrize("kwargs, message", [
    (dict(moe_router_topk_scaling_factor=0.0), "moe_router_topk_scaling_factor must be "
                                               "positive"),
    (dict(moe_aux_loss_coeff=-0.01), r"moe_aux_loss_coeff must be >= 0"),
    (dict(moe_z_loss_coeff=-1e-3), r"moe_z_loss_coeff must be >= 0"),
    (dict(moe_shared_expert_intermediate_size=0), "must be positive"),
])
def test_moe_section_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**MOE, **kwargs)


def test_moe_layouts_that_work():
    # tp without sequence parallelism, etp 1 with biases, allgather with fixed lengths
    make(4, model={**MOE, "seq_length": 32}, parallel=dict(tensor_model_parallel_size=2,
                                                           expert_model_parallel_size=2))
    make(4, model=MOE, parallel=dict(tensor_model_parallel_size=4,
                                     expert_tensor_parallel_size=1))
    make(2, model={**MOE, "moe_token_dispatcher_type": "allgather"},
         parallel=dict(expert_model_parallel_size=2))
