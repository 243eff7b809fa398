"""Lion (``--optimizer lion``: Lion for the linear weights, AdamW for the rest; and Muon's
``--muon-scalar-optimizer lion``) on one process: the update against a reference written
here, its state and resumption, and bad input."""

import pytest
import torch

from megalite.config import OptimConfig
from megalite.config.fields import ConfigError
from megalite.models.gpt import GPTModel
from megalite.optim.algorithms.lion import LionOptimizer
from megalite.optim.loss_scaler import build_loss_scaler
from megalite.optim.optimizer import MixedPrecisionOptimizer
from megalite.parallel.state import ParallelState
from tests.training.common import tiny_config

GQA = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
       "add_bias_linear": False, "group_query_attention": True, "num_query_groups": 2}


def _lion_reference(p, moment, g, lr, wd, beta1, beta2):
    """One Lion step of one tensor, written from the paper's algorithm (Chen et al. 2023,
    Algorithm 2, decoupled weight decay); returns the new (p, moment)."""
    c = beta1 * moment + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * torch.sign(c)
    return p, beta2 * moment + (1 - beta2) * g


def _grads(named, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=gen) for n, p in named.items()}
            for _ in range(steps)]


def _build(ocfg, model=GQA):
    cfg = tiny_config(1, model=model)
    ps = ParallelState.build(cfg.parallel)
    model = GPTModel(cfg.model, ps)
    return model, MixedPrecisionOptimizer(model, ocfg, ps, build_loss_scaler(ocfg, False))


def _step(model, opt, grads):
    for n, p in model.named_parameters():
        p.main_grad = grads[n].clone()
    assert opt.step().updated


@pytest.mark.parametrize("model", [GQA, {**GQA, "num_experts": 2}, {}],
                         ids=["dense", "moe", "gpt2"])
def test_lion_update_matches_the_reference(model):
    """Three steps: Lion for the linear layers' weights (the router's and the expert
    stacks' included), torch's AdamW for the embedding, output layer and norms, as
    Megatron-LM splits them; every parameter equals the reference's (weight decay on the
    matrices only), and the state is Lion's one fp32 ``exp_avg`` or AdamW's moments."""
    ocfg = OptimConfig(optimizer="lion", lr=0.01, weight_decay=0.1, clip_grad=0.0,
                       lion_beta1=0.9, lion_beta2=0.99, adam_beta1=0.8)
    model, opt = _build(ocfg, model)
    named = dict(model.named_parameters())
    lion = {n for n, p in named.items() if p.dim() > 1
            and n not in ("embedding.word_embeddings.weight", "output_layer.weight")}
    assert any("router" in n for n in lion) == ("decoder.layers.0.mlp.router.weight" in named)
    assert any("position_embeddings" in n for n in lion) == any(
        "position_embeddings" in n for n in named)
    assert {g["rule"] for g in opt.param_groups} == {"lion", "adam"}
    initial = {n: p.detach().clone() for n, p in named.items()}
    want = dict(initial)
    moments = {n: torch.zeros_like(p) for n, p in named.items()}
    adam = {}
    for n in set(named) - lion:
        leaf = torch.nn.Parameter(initial[n].clone())
        adam[n] = (leaf, torch.optim.AdamW(
            [leaf], lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2), eps=ocfg.adam_eps,
            weight_decay=ocfg.weight_decay if named[n].dim() > 1 else 0.0, foreach=False))
    for grads in _grads(named, 3):
        _step(model, opt, grads)
        for n in lion:
            want[n], moments[n] = _lion_reference(want[n], moments[n], grads[n], ocfg.lr,
                                                  ocfg.weight_decay, 0.9, 0.99)
        for n, (leaf, adamw) in adam.items():
            leaf.grad = grads[n].clone()
            adamw.step()
            want[n] = leaf.detach()
    for n, p in named.items():
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=1e-6, msg=n)
    for n in lion:   # three sign steps of lr: every element moved
        assert ((named[n].detach() - initial[n]).abs() > ocfg.lr / 2).all(), n
    state = opt.state_dict_per_param()
    assert state["step"] == 3
    for n, entry in state["params"].items():
        assert set(entry) == ({"exp_avg"} if n in lion else {"exp_avg", "exp_avg_sq"}), n
        if n in lion:
            torch.testing.assert_close(entry["exp_avg"], moments[n], rtol=1e-6, atol=1e-7)


def test_lion_resumes_bit_exactly():
    """Two steps, the per-parameter state into a fresh optimizer (and fresh weights), a
    third step: bitwise the uninterrupted run's."""
    ocfg = OptimConfig(optimizer="lion", lr=0.01, weight_decay=0.1, clip_grad=0.0)
    model, opt = _build(ocfg)
    steps = _grads(dict(model.named_parameters()), 3, seed=2)
    for grads in steps[:2]:
        _step(model, opt, grads)
    saved = opt.state_dict_per_param()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt, steps[2])

    model2, opt2 = _build(ocfg)
    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(weights[n])
    opt2.load_state_dict_per_param(saved)
    _step(model2, opt2, steps[2])
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n


def test_muon_with_the_lion_scalar_optimizer():
    """``--optimizer muon --muon-scalar-optimizer lion``: the matrices keep Muon's
    momentum, the embedding, output layer and norms Lion's ``exp_avg`` and Lion's update."""
    ocfg = OptimConfig(optimizer="muon", muon_scalar_optimizer="lion", lr=0.02,
                       weight_decay=0.1, clip_grad=0.0, lion_beta1=0.9)
    model, opt = _build(ocfg)
    assert {g["rule"] for g in opt.param_groups} == {"muon", "lion"}
    named = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    grads = _grads(named, 1, seed=3)[0]
    _step(model, opt, grads)
    state = opt.state_dict_per_param()["params"]
    assert set(state["decoder.layers.0.self_attention.linear_qkv.weight"]) == {
        "momentum_buffer"}
    for n in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight"):
        assert set(state[n]) == {"exp_avg"}, n
        wd = ocfg.weight_decay if named[n].dim() > 1 else 0.0
        want, _ = _lion_reference(before[n], torch.zeros_like(before[n]), grads[n], ocfg.lr,
                                  wd, 0.9, ocfg.lion_beta2)
        torch.testing.assert_close(named[n].detach(), want, rtol=0, atol=1e-7, msg=n)


def test_a_tensor_without_gradient_is_not_touched():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = LionOptimizer([{"params": [p, q]}], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    assert opt.adam is None
    p.grad = torch.tensor([1.0, -2.0, 0.0])
    opt.step()
    assert torch.equal(q.detach(), torch.ones(3)) and q not in opt.state
    torch.testing.assert_close(p.detach(), torch.tensor([0.85, 1.05, 0.95]))


def test_lion_flags_need_lion():
    with pytest.raises(ConfigError, match="--lion-beta1 has no effect with --optimizer "
                                          "adam; use --optimizer lion"):
        OptimConfig(lion_beta1=0.9)
    with pytest.raises(ConfigError, match="--lion-beta2 has no effect with --optimizer "
                                          "muon"):
        OptimConfig(optimizer="muon", lion_beta2=0.9)
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\)"):
        OptimConfig(optimizer="lion", lion_beta2=1.0)
    with pytest.raises(ConfigError, match="--muon-scalar-optimizer has no effect with "
                                          "--optimizer lion"):
        OptimConfig(optimizer="lion", muon_scalar_optimizer="lion")
    assert OptimConfig(optimizer="muon", muon_scalar_optimizer="lion", lion_beta1=0.9)


def test_a_bf16_model_steps_its_fp32_masters_with_lion():
    """bf16 weights: Lion and AdamW step the fp32 masters (Lion's step from the masters,
    not the rounded weights) and the weights are the masters rounded to bf16."""
    ocfg = OptimConfig(optimizer="lion", lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    model, opt = _build(ocfg, {**GQA, "bf16": True})
    named = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in named.values())
    masters = {n: m.detach().clone() for n, m in zip(opt.names, opt.masters)}
    grads = _grads(named, 1, seed=4)[0]
    _step(model, opt, grads)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    want, _ = _lion_reference(masters[name], torch.zeros_like(masters[name]), grads[name],
                              ocfg.lr, ocfg.weight_decay, ocfg.lion_beta1, ocfg.lion_beta2)
    master = dict(zip(opt.names, opt.masters))[name]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master, want, rtol=0, atol=1e-7)
    assert torch.equal(named[name].detach(), master.to(torch.bfloat16))


def test_an_fp16_model_unscales_the_gradients_before_lion():
    """fp16 with a static loss scale of 1024: Lion steps the fp32 masters with the
    unscaled gradients (Megatron-LM refuses fp16 for its emerging optimizers; megalite's
    Lion takes fp16 like its other optimizers)."""
    ocfg = OptimConfig(optimizer="lion", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                       loss_scale=1024.0)
    cfg = tiny_config(1, model={**GQA, "fp16": True})
    ps = ParallelState.build(cfg.parallel)
    model = GPTModel(cfg.model, ps)
    opt = MixedPrecisionOptimizer(model, ocfg, ps, build_loss_scaler(ocfg, True))
    named = dict(model.named_parameters())
    masters = {n: m.detach().clone() for n, m in zip(opt.names, opt.masters)}
    grads = _grads(named, 1, seed=5)[0]
    for n, p in named.items():
        p.main_grad = grads[n] * 1024.0
    assert opt.step().updated
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    want, _ = _lion_reference(masters[name], torch.zeros_like(masters[name]), grads[name],
                              ocfg.lr, ocfg.weight_decay, ocfg.lion_beta1, ocfg.lion_beta2)
    torch.testing.assert_close(dict(zip(opt.names, opt.masters))[name], want, rtol=0,
                               atol=1e-7)
    assert named[name].dtype == torch.float16
