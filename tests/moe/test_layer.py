"""The MoE layer on one process: Hugging Face Mixtral parity, capacity by hand, bad input."""

import pytest
import torch

from megalite.config import ConfigError, MegaliteConfig, ModelConfig, ParallelConfig
from megalite.moe.layer import MoELayer, moe_layer_pattern, moe_layers, set_aux_loss_scale
from megalite.parallel.state import ParallelState
from tests.moe.reference import naive_moe


def _state():
    return ParallelState.build(ParallelConfig())


def _cfg(**kw):
    return ModelConfig(**{"hidden_size": 8, "num_experts": 4, "moe_router_topk": 2,
                          "moe_ffn_hidden_size": 6, "swiglu": True, "add_bias_linear": False,
                          "num_layers": 2, "init_method_std": 0.3, **kw})


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_matches_hf_mixtral_block_with_documented_mapping():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    layer = MoELayer(_cfg(), _state(), layer_number=0, seed=1)
    hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=8, intermediate_size=6,
                                             num_local_experts=4, num_experts_per_tok=2))
    with torch.no_grad():  # the mapping documented in the report / layer docstring
        hf.gate.weight.copy_(layer.router.weight)                    # [E, h]
        hf.experts.gate_up_proj.copy_(layer.experts.fc1.transpose(1, 2))  # [E, 2f, h]
        hf.experts.down_proj.copy_(layer.experts.fc2.transpose(1, 2))     # [E, h, f]
    x = _rand(0, 5, 3, 8)  # [s, b, h]
    g = _rand(1, 5, 3, 8)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = layer(x1)
    theirs = hf(x2.transpose(0, 1).contiguous()).transpose(0, 1)  # HF is [b, s, h]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    (ours * g).sum().backward()
    (theirs * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.weight.grad, hf.gate.weight.grad,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.experts.fc1.grad.transpose(1, 2),
                               hf.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.experts.fc2.grad.transpose(1, 2),
                               hf.experts.down_proj.grad, rtol=1e-5, atol=1e-6)


def _hand_layer(**kw):
    """h = E = 4 and router weight = identity, so each token's logits are the token."""
    layer = MoELayer(_cfg(hidden_size=4, moe_expert_capacity_factor=1.0, **kw), _state(),
                     layer_number=0, seed=2)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    x = torch.tensor([[3.0, 2.0, 0.0, 0.0],    # top-2 {0: .73, 1: .27}
                      [2.0, 3.0, 0.0, 0.0],    # {1: .73, 0: .27}
                      [4.0, 0.0, 1.0, 0.0],    # {0: .95, 2: .05}
                      [1.0, 0.0, 0.0, 3.0]])   # {3: .88, 0: .12}
    return layer, x


@pytest.mark.parametrize("policy, dropped", [("probs", [1, 3]), ("position", [2, 3])])
def test_capacity_drops_by_hand(policy, dropped):
    # 4 tokens x top-2 / 4 experts x factor 1 -> capacity 2; all four want expert 0
    outs = []
    for pad in (False, True):
        layer, x = _hand_layer(moe_token_drop_policy=policy,
                               moe_pad_expert_input_to_capacity=pad)
        outs.append(layer(x.view(4, 1, 4)).view(4, 4))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[dropped, 0] = False
    want = naive_moe(x, layer.router.weight, layer.experts.fc1, layer.experts.fc2, k=2,
                     swiglu=True, keep=keep)
    torch.testing.assert_close(outs[0], want)
    torch.testing.assert_close(outs[1], want)  # padding tokens carry probability 0


def test_dropless_by_default_and_bias_gelu_shared_expert_reference():
    cfg = _cfg(swiglu=False, add_bias_linear=True, moe_shared_expert_intermediate_size=4)
    layer = MoELayer(cfg, _state(), layer_number=0, seed=3)
    with torch.no_grad():
        for p in (layer.experts.fc1_bias, layer.experts.fc2_bias):
            p.normal_()
    x = _rand(4, 6, 2, 8)
    e = layer.experts
    want = naive_moe(x.view(12, 8), layer.router.weight, e.fc1, e.fc2, k=2, swiglu=False,
                     fc1_bias=e.fc1_bias, fc2_bias=e.fc2_bias)
    want = want.view(6, 2, 8) + layer.shared_experts(x)
    torch.testing.assert_close(layer(x), want)


def aux_loss_summary(model: torch.nn.Module) -> dict:
    """Mean over ``model``'s MoE layers of their last forward's ``aux_losses`` (floats)."""
    sums: dict = {}
    layers = moe_layers(model)
    for layer in layers:
        for name, value in layer.aux_losses.items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return {name: total / len(layers) for name, total in sums.items()}


def test_aux_loss_scale_and_summary():
    model = torch.nn.ModuleList([
        MoELayer(_cfg(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), _state(), i, seed=4)
        for i in range(2)])
    set_aux_loss_scale(model, 0.5)
    assert [m.aux_loss_scale for m in model] == [0.5, 0.5]
    x = _rand(5, 4, 2, 8)
    for m in model:
        m(x)
    summary = aux_loss_summary(model)
    assert set(summary) == {"moe_aux_loss", "moe_z_loss"}
    want = sum(float(m.aux_losses["moe_aux_loss"]) for m in model) / 2
    assert summary["moe_aux_loss"] == pytest.approx(want)


def test_output_keeps_input_dtype():
    layer = MoELayer(_cfg(bf16=True), _state(), layer_number=0, seed=5)
    assert layer.experts.fc1.dtype == torch.bfloat16
    out = layer(_rand(6, 4, 2, 8).bfloat16())
    assert out.dtype == torch.bfloat16 and out.shape == (4, 2, 8)


def test_bad_input_is_reported():
    with pytest.raises(ConfigError, match=r"moe_router_topk \(5\) must be <= num_experts"):
        ModelConfig(num_experts=4, moe_router_topk=5)
    cfg = MegaliteConfig(model=ModelConfig(num_experts=6),
                         parallel=ParallelConfig(expert_model_parallel_size=4))
    with pytest.raises(ConfigError, match=r"num_experts \(6\) must be divisible by "
                                          r"expert_model_parallel_size \(4\)"):
        cfg.validate(4)
    with pytest.raises(ConfigError, match="needs --num-experts"):
        MoELayer(ModelConfig(), _state(), layer_number=0, seed=0)

    # the layer asks the one place these rules live: ModelConfig.check_layout
    with pytest.raises(ConfigError, match=r"num_experts \(6\) must be divisible by "
                                          r"expert_model_parallel_size \(4\)"):
        _cfg(num_experts=6).check_layout(tp=1, ep=4, etp=1)
    with pytest.raises(ConfigError, match=r"moe_ffn_hidden_size \(6\) must be divisible"):
        _cfg(hidden_size=8, num_attention_heads=4, ffn_hidden_size=8).check_layout(
            tp=4, ep=1, etp=4)
    with pytest.raises(ConfigError, match="expert biases need"):
        _cfg(add_bias_linear=True, moe_ffn_hidden_size=8, num_attention_heads=4,
             ffn_hidden_size=8).check_layout(tp=4, etp=2)


def test_moe_layer_pattern():
    assert moe_layer_pattern(_cfg(num_layers=3)) == [True, True, True]
    assert moe_layer_pattern(_cfg(num_layers=5, moe_layer_freq=2)) == [True, False, True,
                                                                       False, True]
    assert moe_layer_pattern(ModelConfig(num_layers=2)) == [False, False]


def test_moe_layer_freq_list_expression_flows_to_shapes_and_flops():
    from megalite.arguments import parse_args
    from megalite.config import shapes

    cfg = _cfg(num_layers=5, moe_layer_freq="[0]*2+[1]*3")
    assert moe_layer_pattern(cfg) == [False, False, True, True, True]
    assert shapes.moe_layer_count(cfg) == 3 and not shapes.is_moe_layer(cfg, 1)
    dense_first = _cfg(num_layers=5, moe_layer_freq="[1]*3+[0]*2")
    every = _cfg(num_layers=5)
    # the same number of MoE layers, so the same active parameters and FLOPs
    assert shapes.active_layer_params(cfg) == shapes.active_layer_params(dense_first)
    router, experts = shapes.moe_mlp_params(cfg, 1, 1, 1)
    moe_active = router + experts // 4 * 2     # the router and top-2 of 4 experts
    assert (shapes.active_layer_params(cfg) - shapes.active_layer_params(every)
            == 2 * (shapes.dense_mlp_params(cfg, 1) - moe_active))
    # Megatron's spelling on the command line; "2" stays the integer form
    args = parse_args(["--num-layers", "4", "--num-experts", "4",
                       "--moe-layer-freq", "[0]*1+[1]*3"])
    assert moe_layer_pattern(args.model) == [False, True, True, True]
    assert parse_args(["--num-experts", "4", "--moe-layer-freq", "2"]).model.moe_layer_freq == 2
    for bad, match in (("[1]*4", "lists 4 layers"), ("[0,2,1,1,1]", "only 0"),
                       ("__import__('os')", "neither an integer"), ("0", "positive"),
                       ("[0]*10000000000", "neither an integer")):  # refused before built
        with pytest.raises(ConfigError, match=match):
            _cfg(num_layers=5, moe_layer_freq=bad)


def test_flex_dispatcher_runs_as_alltoall_and_is_named_at_start():
    from megalite.compat import NO_EFFECT, flag_status, no_effect_line
    from megalite.moe.dispatcher import DISPATCHERS, AllToAllDispatcher

    assert DISPATCHERS["flex"] is AllToAllDispatcher
    cfg = MegaliteConfig(model=_cfg(moe_token_dispatcher_type="flex",
                                    moe_flex_dispatcher_backend="hybridep"))
    line = no_effect_line(cfg)
    assert "--moe-token-dispatcher-type flex (DeepEP / HybridEP" in line
    assert "--moe-flex-dispatcher-backend hybridep" in line
    assert no_effect_line(MegaliteConfig(model=_cfg())) is None
    assert flag_status("--moe-token-dispatcher-type", ["flex"])[0] == NO_EFFECT
    assert flag_status("--moe-token-dispatcher-type", ["alltoall"])[0] != NO_EFFECT
