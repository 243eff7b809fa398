"""Muon on one process: Newton-Schulz, the scale modes, and the optimizer's update against
a reference written here (momentum, Nesterov, Q/K/V apart, experts one at a time, AdamW for
the rest); bad input refused with one clear error."""

import pytest
import torch

from megalite.config import OptimConfig
from megalite.config.fields import ConfigError
from megalite.models.gpt import GPTModel
from megalite.optim.loss_scaler import build_loss_scaler
from megalite.optim.muon_layout import assign_owners, check_matrix
from megalite.optim.newton_schulz import (COEFFICIENTS, ITERATION_DTYPE, coefficients, iterate,
                                          orthogonalize)
from megalite.optim.optimizer import MixedPrecisionOptimizer
from megalite.parallel.params import mark_param
from megalite.parallel.state import ParallelState
from tests.training.common import tiny_config

GQA_MOE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
           "add_bias_linear": False, "group_query_attention": True, "num_query_groups": 2,
           "num_experts": 2}


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_singular_values(shape):
    """quintic (5 steps) within its known band around 1, simple within Jordan's wider one,
    polar_express (8 steps) at 1; the singular vectors are those of the input."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    bands = {("quintic", 5): 0.05, ("simple", 5): 0.35, ("polar_express", 8): 1e-3}
    for (kind, steps), band in bands.items():
        o = orthogonalize(x, steps, kind)
        s = torch.linalg.svdvals(o)
        assert (s - 1).abs().max() < band, (kind, s)
        # same singular vectors: U^T O V is diagonal
        inner = u.T @ o @ vh.T
        off = inner - torch.diag(torch.diagonal(inner))
        assert off.abs().max() < 1e-4, kind
    # the quintic band is not exact, polar express is far tighter
    assert (torch.linalg.svdvals(orthogonalize(x, 5, "quintic")) - 1).abs().max() > 1e-3


@pytest.mark.parametrize("precision", ["low", "medium", "high"])
def test_matmul_precision_leaves_the_cpu_in_ieee_fp32(precision):
    """--muon-fp32-matmul-prec lowers the iteration's precision on GPUs only: on the CPU
    the result is bitwise the IEEE one and torch's global setting is left as it was."""
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(5))
    before = torch.get_float32_matmul_precision()
    assert torch.equal(orthogonalize(x, 5, "quintic", precision), orthogonalize(x, 5))
    assert torch.get_float32_matmul_precision() == before


def test_the_bf16_iteration_of_medium_precision():
    """``--muon-fp32-matmul-prec medium`` / ``low`` run the GPU's iteration on bf16 copies
    (Megatron-LM's meaning), ``high`` in fp32 (TF32). The bf16 iteration, run here on the
    CPU: the singular values in quintic's band, the result within bf16's rounding of the
    fp32 one, and each matrix's result bitwise the same alone or in a batch."""
    assert ITERATION_DTYPE == {"low": torch.bfloat16, "medium": torch.bfloat16,
                               "high": torch.float32}
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, 48, generator=g)
    exact = iterate(x, 5, "quintic")
    low = iterate(x, 5, "quintic", dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and low.shape == x.shape
    s = torch.linalg.svdvals(low)
    assert (s - 1).abs().max() < 0.05, s
    rel = (low - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))
    assert 1e-3 < rel.max() < 1.5e-2, rel          # bf16 rounding, but no more than that
    for i in range(4):
        assert torch.equal(iterate(x[i], 5, "quintic", dtype=torch.bfloat16), low[i])


def test_coefficient_schedules():
    assert coefficients("simple", 3) == [COEFFICIENTS["simple"][0]] * 3
    assert coefficients("quintic", 10) == list(COEFFICIENTS["quintic"]) * 2
    pe = COEFFICIENTS["polar_express"]
    assert coefficients("polar_express", 10) == list(pe) + [pe[-1]] * 2
    with pytest.raises(ValueError, match="multiple of 5"):
        coefficients("quintic", 3)
    with pytest.raises(ValueError, match="at least 8"):
        coefficients("polar_express", 5)


# -- the optimizer against a reference -------------------------------------------------
def _ref_ns(x, kind, steps):
    t = x.shape[0] > x.shape[1]
    x = x.T if t else x
    x = x / x.norm().clamp_min(1e-7)
    for a, b, c in coefficients(kind, steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if t else x


def _ref_scale(out, inp, mode):
    return {"spectral": max(out, inp) ** 0.5, "unit_rms_norm": (out / inp) ** 0.5,
            "shape_scaling": max(1, out / inp) ** 0.5}[mode]


def _ref_orth(name, u, o):
    """Reference O of ``u`` for parameter ``name`` under OptimConfig ``o``."""
    def one(x, out, inp):
        return _ref_ns(x, o.muon_coefficient_type, o.muon_num_ns_steps) \
            * _ref_scale(out, inp, o.muon_scale_mode) * o.muon_extra_scale_factor
    if name.endswith(("experts.fc1", "experts.fc2")):      # [E, in, out], one expert at a time
        return torch.stack([one(x, x.shape[1], x.shape[0]) for x in u])
    if name.endswith("linear_qkv.weight") and o.muon_split_qkv:
        q, k, v = u.split([32, 16, 16])                      # 4 heads of 8, 2 query groups
        return torch.cat([one(x, *x.shape) for x in (q, k, v)])
    return one(u, *u.shape)


def _reference(params, grads_per_step, o):
    """Muon for the matrices, torch's single-tensor AdamW for the others."""
    params = {n: p.detach().clone() for n, p in params.items()}
    moms = {n: torch.zeros_like(p) for n, p in params.items()}
    adam = {}
    for n, p in params.items():
        if p.dim() > 1 and not any(w in n for w in ("embedding", "output_layer", "router")):
            continue
        wd = o.weight_decay if p.dim() > 1 else 0.0
        leaf = torch.nn.Parameter(p)
        adam[n] = (leaf, torch.optim.AdamW([leaf], lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                           eps=o.adam_eps, weight_decay=wd, foreach=False))
    for grads in grads_per_step:
        for n, p in params.items():
            g = grads[n]
            if n in adam:
                leaf, opt = adam[n]
                leaf.grad = g.clone()
                opt.step()
                continue
            beta = o.muon_momentum
            moms[n] = beta * moms[n] + (1 - beta) * g
            u = (1 - beta) * g + beta * moms[n] if o.muon_nesterov else moms[n]
            p.mul_(1 - o.lr * o.weight_decay)
            p.sub_(o.lr * _ref_orth(n, u, o))
    return {n: (adam[n][0].detach() if n in adam else p) for n, p in params.items()}


@pytest.mark.parametrize("muon", [
    {},
    {"muon_nesterov": True, "muon_scale_mode": "unit_rms_norm",
     "muon_extra_scale_factor": 0.2, "muon_coefficient_type": "polar_express",
     "muon_num_ns_steps": 9},
    {"muon_split_qkv": False, "muon_scale_mode": "shape_scaling", "muon_momentum": 0.8,
     "muon_coefficient_type": "simple", "muon_num_ns_steps": 4},
], ids=["defaults", "nesterov-unit_rms-polar", "unsplit-shape-simple"])
def test_single_process_update_matches_reference(muon):
    cfg = tiny_config(1, model=GQA_MOE)
    ocfg = OptimConfig(optimizer="muon", lr=0.02, weight_decay=0.1, clip_grad=0.0, **muon)
    ps = ParallelState.build(cfg.parallel)
    model = GPTModel(cfg.model, ps)
    named = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    steps = [{n: torch.randn(p.shape, generator=gen) for n, p in named.items()}
             for _ in range(3)]
    want = _reference(named, steps, ocfg)
    opt = MixedPrecisionOptimizer(model, ocfg, ps, build_loss_scaler(ocfg, False))
    for grads in steps:
        for n, p in named.items():
            p.main_grad = grads[n].clone()
        assert opt.step().updated
    rules = {g["rule"] for g in opt.param_groups}
    assert rules == {"muon", "adam"}
    for n, p in named.items():
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=2e-6, msg=n)
    state = opt.state_dict_per_param()["params"]
    assert set(state["decoder.layers.0.self_attention.linear_qkv.weight"]) == {
        "momentum_buffer"}
    assert set(state["embedding.word_embeddings.weight"]) == {"exp_avg", "exp_avg_sq"}
    assert set(state["decoder.layers.0.mlp.router.weight"]) == {"exp_avg", "exp_avg_sq"}


def test_muon_flags_need_muon_and_fitting_steps():
    with pytest.raises(ConfigError, match="--muon-tp-mode has no effect with --optimizer "
                                          "adam"):
        OptimConfig(muon_tp_mode="blockwise")
    with pytest.raises(ConfigError, match="--muon-no-split-qkv has no effect with "
                                          "--optimizer sgd"):
        OptimConfig(optimizer="sgd", muon_split_qkv=False)
    with pytest.raises(ConfigError, match="multiple of 5"):
        OptimConfig(optimizer="muon", muon_num_ns_steps=3)
    with pytest.raises(ConfigError, match="must be one of"):
        OptimConfig(optimizer="muon", muon_tp_mode="rowwise")


def test_a_matrix_muon_cannot_orthogonalise_is_named():
    ocfg = OptimConfig(optimizer="muon")
    p = mark_param(torch.nn.Parameter(torch.zeros(64, 32)), partition_dim=0,
                   unpadded_size=60, init_std=0.02)
    with pytest.raises(ValueError, match="cannot orthogonalise decoder.proj.weight: it is "
                                         "padded"):
        check_matrix("decoder.proj.weight", p, ocfg)


def test_a_tp_mode_that_does_not_apply():
    muon = {"optimizer": "muon", "muon_tp_mode": "distributed"}
    with pytest.raises(ConfigError, match="--muon-tp-mode distributed does not apply at "
                                          "--tensor-model-parallel-size 1: every matrix"):
        tiny_config(1, optim=muon)
    with pytest.raises(ConfigError, match="with --expert-tensor-parallel-size 1"):
        tiny_config(2, optim=muon, model={"num_experts": 2},
                    parallel={"expert_model_parallel_size": 2})
    assert tiny_config(2, optim=muon, parallel={"tensor_model_parallel_size": 2})


def test_owners_balance_newton_schulz_flops():
    """Longest first onto the least loaded rank: every rank gets work, the loads differ by
    at most the largest item, and the plan is a pure function of the costs."""
    costs = [9.0, 1.0, 4.0, 4.0, 3.0, 2.0, 2.0, 7.0]
    owners = assign_owners(costs, 3)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert sorted(loads) == [10.0, 11.0, 11.0]
    assert owners == assign_owners(list(costs), 3)
    assert assign_owners(costs, 1) == [0] * len(costs)
