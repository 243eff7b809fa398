"""megalite -> Megatron-Core torch_dist (``convert_checkpoint.py --target megatron``).

Megatron-Core itself is not in CI: its loading of these files was checked with
``tests/checkpoint/megatron/make_fixtures.py --check-export`` (the export of each imported
fixture, loaded by Megatron-LM's ``load_checkpoint`` at the fixture's tp x pp and at
another, gives the fixture's logits). Here the written files are held against the ones
Megatron-Core wrote: the same entries (tensors, extra states, common state), shapes and
dtypes, the same tensors, and the common state's args rebuild the same model."""

import json
import os

import pytest
import torch

from megalite.checkpoint.consolidated import load_full_model
from megalite.checkpoint.megatron import read_megatron
from megalite.checkpoint.megatron.files import (
    dcp_metadata,
    find_checkpoint,
    read_common,
    read_tensors,
    tensor_shapes,
)
from tests.checkpoint.test_megatron_import import DIST_NAMES, FIXTURES, convert
from tests.training.common import run_training, tiny_config

VOCAB = 101


def _export(tmp_path, name):
    ml, mt = str(tmp_path / "megalite"), str(tmp_path / "megatron")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.join(FIXTURES, name), "--save-dir", ml) == 0
    with open(os.path.join(FIXTURES, name, "fixture.json")) as f:
        tp = json.load(f)["tp"]
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir", ml,
                   "--save-dir", mt, "--target-tensor-parallel-size", str(tp)) == 0
    return find_checkpoint(os.path.join(FIXTURES, name)), find_checkpoint(mt)


@pytest.mark.parametrize("name", DIST_NAMES)
def test_export_writes_what_megatron_core_writes(tmp_path, name):
    theirs, ours = _export(tmp_path, name)
    assert ours.format == "torch_dist" and ours.iteration == 0
    want, got = dcp_metadata(theirs.directory), dcp_metadata(ours.directory)
    assert sorted(got.state_dict_metadata) == sorted(want.state_dict_metadata)
    shapes_want, shapes_got = tensor_shapes(theirs), tensor_shapes(ours)
    for key, (shape, _) in shapes_want.items():
        assert shapes_got[key][0] == shape, key
        assert got.state_dict_metadata[key].properties.dtype == torch.float32
    a, b = read_tensors(theirs, list(shapes_want)), read_tensors(ours, list(shapes_want))
    for key in shapes_want:
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(a[key][:VOCAB], b[key][:VOCAB]), key
            assert not b[key][VOCAB:].any(), key            # padding rows: zero
        else:
            assert torch.equal(a[key], b[key]), key
    args_want, args_got = read_common(theirs)["args"], read_common(ours)["args"]
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "normalization", "swiglu",
                  "position_embedding_type", "add_bias_linear",
                  "untie_embeddings_and_output_weights", "padded_vocab_size", "vocab_size",
                  "tokenizer_type", "num_experts", "max_position_embeddings", "qk_layernorm",
                  "multi_latent_attention"):
        assert getattr(args_got, field) == getattr(args_want, field), field
    if args_want.multi_latent_attention:
        for field in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                      "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim"):
            assert getattr(args_got, field) == getattr(args_want, field), field
    if args_want.num_experts:
        for field in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                      "moe_shared_expert_intermediate_size", "moe_router_score_function",
                      "moe_router_enable_expert_bias", "moe_router_num_groups",
                      "moe_router_group_topk", "moe_router_topk_scaling_factor",
                      "moe_router_pre_softmax"):
            assert getattr(args_got, field) == getattr(args_want, field), field
    with open(os.path.join(os.path.dirname(ours.directory),
                           "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "0"


LLAMA = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 48,
         "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}
# DeepSeek-V3's shape: multi-latent attention with latent norms and YaRN, a dense first
# layer, fine-grained experts with a shared one, sigmoid group-limited routing, the expert
# bias (moved by the three steps, so nonzero: two steps can cancel)
DEEPSEEK = {**LLAMA, "num_layers": 3, "group_query_attention": False, "num_query_groups": None,
            "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "qk_layernorm": True,
            "rotary_scaling_factor": 4.0, "mscale_all_dim": 1.0, "num_experts": 4,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
            "moe_shared_expert_intermediate_size": 16, "moe_layer_freq": "[0]+[1]*2",
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.01, "moe_router_num_groups": 2,
            "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.0,
            "moe_router_load_balancing_type": "none", "mtp_num_layers": 1}


@pytest.mark.parametrize("model,impl,parallel", [
    (LLAMA, "local", {}), (DEEPSEEK, "transformer_engine", {}),
    ({**LLAMA, "bf16": True}, "local", {"data_parallel_sharding_strategy": "optim_grads_params"}),
], ids=["llama", "deepseek-mtp", "llama-bf16-zero3"])
def test_trained_megalite_checkpoint_round_trips_through_megatron(tmp_path, model, impl,
                                                                   parallel):
    """A megalite run's checkpoint -> Megatron torch_dist (either layer spec's names) ->
    megalite: the same weights (expert biases and the prediction depth's included), the
    same model flags, and the same optimizer state (moments, fp32 main weights of a bf16
    run, step, iteration, consumed samples, the schedule's position), in the plain
    optimizer's format or, for a run that sharded its optimizer, the distributed one's."""
    from megalite.checkpoint.consolidated import load_full_training_state

    save, mt = str(tmp_path / "run"), str(tmp_path / "megatron")
    iters = 3 if model is DEEPSEEK else 2
    run_training(tiny_config(model=model, parallel=parallel, train={"train_iters": iters},
                             checkpoint={"save": save}))
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir", save,
                   "--save-dir", mt, "--target-pipeline-parallel-size", "2",
                   "--transformer-impl", impl) == 0
    common = read_common(find_checkpoint(mt))
    assert ("distrib_optim_sharding_type" in common["content_metadata"]) == bool(parallel)
    cfg, _, state, scheduler = load_full_training_state(save)
    back = read_megatron(mt)
    assert back.optimizer.params.keys() == state["params"].keys()
    for name, entry in state["params"].items():
        got = back.optimizer.params[name]
        assert got.keys() >= entry.keys(), name
        for k, t in entry.items():
            assert torch.equal(got[k], t), (name, k)
    o = back.optimizer
    gbs = cfg.train.global_batch_size
    assert (o.step, o.iteration, o.consumed_samples) == (iters, iters, iters * gbs)
    assert o.scheduler_samples == scheduler.num_steps * gbs == iters * gbs
    assert read_common(find_checkpoint(mt))["args"].transformer_impl == impl
    assert find_checkpoint(mt).iteration == iters
    back = read_megatron(mt)
    _, trained = load_full_model(save)
    want = trained.full_state_dict()
    assert back.state.keys() == want.keys()
    for key, tensor in want.items():
        assert torch.equal(back.state[key], tensor), key
    biases = [t for k, t in want.items() if k.endswith("expert_bias") and "mtp." not in k]
    assert len(biases) == (2 if model is DEEPSEEK else 0)
    assert ("mtp.layers.0.transformer_layer.mlp.router.expert_bias" in want) == \
        ("mtp.layers.0.eh_proj.weight" in want) == (model is DEEPSEEK)
    assert all(b.abs().max() > 0 for b in biases)
    for field, value in model.items():
        if value is None:   # a default the config fills in
            continue
        got = getattr(back.cfg.model, field)
        assert got == (value.replace("[0]+[1]*2", "[0,1,1]") if field == "moe_layer_freq"
                       else value), field


def test_flag_table_says_torch_dist_is_megalites_own_format():
    from megalite.compat import DIFFERENT, flag_status

    status, reason = flag_status("--ckpt-format", ["torch_dist"])
    assert status == DIFFERENT
    assert "--source megatron" in reason and "--target megatron" in reason


@pytest.mark.parametrize("changes, message", [
    ({"num_experts": 4, "add_bias_linear": True, "swiglu": False,
      "normalization": "LayerNorm"},
     "tensors with no Megatron-Core counterpart, e.g. decoder.layers.0.mlp.experts.fc1_bias"),
    ({**DEEPSEEK, "original_max_position_embeddings": 8192},
     "--original-max-position-embeddings 8192 (Megatron-Core's multi-latent attention "
     "corrects YaRN for 4096 positions)"),
    ({"position_embedding_type": "learned_absolute", "mtp_num_layers": 1},
     "--mtp-num-layers 1 with learned absolute position embeddings (Megatron-LM builds "
     "multi-token prediction only with rope or no positions)"),
])
def test_what_megatron_would_build_otherwise_is_refused(tmp_path, capsys, changes, message):
    from megalite.checkpoint.consolidated import save_full_model, single_process_state
    from megalite.models.gpt import GPTModel

    cfg = tiny_config(model=changes)
    save = str(tmp_path / "ml")
    save_full_model(cfg, GPTModel(cfg.model, single_process_state()).full_state_dict(), save)
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir", save,
                   "--save-dir", str(tmp_path / "mt")) == 4
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


# What Megatron-Core 0.19.2's layer specs (models/gpt/gpt_layer_specs.py) call a layer's
# norms where the two --transformer-impl differ: Transformer Engine's fuses a norm into a
# following LayerNorm*Linear (standard attention's QKV, a dense MLP's fc1, multi-latent
# attention's up projections under --qk-layernorm) and keeps an MoE layer's pre-MLP norm
# (TENorm); the local spec maps standard attention's norms to the fused names
# (sharded_state_dict_keys_map, MoE layers too) and keeps multi-latent attention's own.
# fixture -> {the local name it was saved with: Transformer Engine's}
TE_RENAMES = {
    "mixtral_ep2": {"mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"},
    "deepseek_v3_mtp_ep2": {   # layer 0 dense, layer 1 and the depth's layer MoE
        "decoder.layers.0.pre_mlp_layernorm.weight":
            "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
        "self_attention.kv_layernorm.weight":
            "self_attention.linear_kv_up_proj.layer_norm_weight"},
    "llama_mtp_tp2_pp2": {},   # dense standard attention: the same names
}


@pytest.mark.parametrize("name", sorted(TE_RENAMES))
def test_transformer_engine_export_names_the_norms_as_its_spec_does(tmp_path, name):
    """``--transformer-impl transformer_engine`` (Megatron-LM's default; the import of a
    local-spec fixture records ``local`` and exports it by default): the fixture's entries
    with Transformer Engine's norm names, the same tensors, and the import of that export
    is the import of the fixture."""
    ml, mt = str(tmp_path / "megalite"), str(tmp_path / "megatron")
    theirs = find_checkpoint(os.path.join(FIXTURES, name))
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.dirname(theirs.directory), "--save-dir", ml) == 0
    tp = read_common(theirs)["args"].tensor_model_parallel_size   # the same vocab padding
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir", ml,
                   "--save-dir", mt, "--transformer-impl", "transformer_engine",
                   "--target-tensor-parallel-size", str(tp)) == 0
    ours = find_checkpoint(mt)
    assert read_common(ours)["args"].transformer_impl == "transformer_engine"

    def te_name(key):
        for local, te in TE_RENAMES[name].items():
            if key.endswith(local) and (local.startswith("decoder.") or "." + local in key):
                return key[:len(key) - len(local)] + te
        return key

    want = {te_name(k): v for k, v in tensor_shapes(theirs).items()}
    got = tensor_shapes(ours)
    assert got.keys() == want.keys()
    renamed = sum(te_name(k) != k for k in tensor_shapes(theirs))
    assert renamed == {"mixtral_ep2": 1, "deepseek_v3_mtp_ep2": 7, "llama_mtp_tp2_pp2": 0}[name]
    assert all(got[k][0] == want[k][0] for k in want)
    a = read_tensors(theirs, [k for k in tensor_shapes(theirs) if "_extra_state" not in k
                              and k not in ("embedding.word_embeddings.weight",
                                            "output_layer.weight", "common_state/shard_0_1")])
    b = read_tensors(ours, [te_name(k) for k in a])
    assert all(torch.equal(a[k], b[te_name(k)]) for k in a)
    back, first = read_megatron(mt).state, read_megatron(os.path.dirname(theirs.directory)).state
    assert back.keys() == first.keys() and all(torch.equal(back[k], first[k]) for k in first)


@pytest.mark.parametrize("parallel", [{}, {"data_parallel_sharding_strategy": "optim_grads"}],
                         ids=["plain", "distributed"])
def test_fp16_loss_scale_crosses_to_megatron_and_back(tmp_path, parallel):
    """An fp16 run's dynamic loss scale: its scale, clean steps and hysteresis budget go
    into the ``grad_scaler`` Megatron-Core's fp16 optimizer (plain or distributed) keeps
    beside its torch optimizer, and an import of that checkpoint resumes with them
    instead of --initial-loss-scale (2^32 by default: a dozen skipped steps)."""
    from megalite.checkpoint.consolidated import load_full_training_state

    save, mt, back = (str(tmp_path / d) for d in ("run", "megatron", "back"))
    # a window of 2 clean steps: the scale doubles once in 3 steps, one clean step after
    optim = {"initial_loss_scale": 1024.0, "loss_scale_window": 2}
    run_training(tiny_config(model={"fp16": True}, optim=optim, parallel=parallel,
                             train={"train_iters": 3}, checkpoint={"save": save}))
    scaler = load_full_training_state(save)[2]["loss_scaler"]
    assert (scaler["scale"], scaler["clean_steps"], scaler["hysteresis_left"]) == \
        (2048.0, 1, 2)
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir", save,
                   "--save-dir", mt) == 0
    saved = read_common(find_checkpoint(mt))["optimizer"]["grad_scaler"]
    assert torch.equal(saved["scale"], torch.tensor([2048.0]))
    assert (saved["growth_tracker"], saved["hysteresis_tracker"]) == (1, 2)
    assert read_megatron(mt).optimizer.loss_scaler == \
        {"scale": 2048.0, "clean_steps": 1, "hysteresis_left": 2}
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir", mt,
                   "--save-dir", back) == 0
    again = load_full_training_state(back)[2]["loss_scaler"]
    assert {k: again[k] for k in ("scale", "clean_steps", "hysteresis_left")} == \
        {"scale": 2048.0, "clean_steps": 1, "hysteresis_left": 2}
