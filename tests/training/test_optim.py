"""Optimizer pieces: loss scaling and skipping, clipping across tp, param groups, masters."""

import math

import pytest
import torch

from megalite.config import OptimConfig, ParallelConfig
from megalite.optim.clip_grads import clip_grads_, global_grad_norm
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from megalite.optim.optimizer import MixedPrecisionOptimizer, param_groups
from megalite.parallel.params import mark_param
from megalite.parallel.state import ParallelState
from tests.distributed.harness import parallel_state, run_distributed
from tests.training.common import read_jsonl, run_training, tiny_config


def single_state() -> ParallelState:
    return ParallelState.build(ParallelConfig())


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(self.emb(x))).sum()


# -- loss scaler ------------------------------------------------------------------------
def test_dynamic_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(scale=1024.0, min_scale=1.0, window=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0                      # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(found_inf=True)
    assert s.scale == 256.0                       # hysteresis spent: every overflow halves
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 512.0 and s.hysteresis_left == 2   # window of clean steps doubles
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored == s


def test_scaler_floor_and_builder():
    s = DynamicLossScaler(scale=2.0, min_scale=1.0, window=100, hysteresis=1)
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 1.0
    assert build_loss_scaler(OptimConfig(), fp16=False) == ConstantLossScaler(1.0)
    assert build_loss_scaler(OptimConfig(loss_scale=128.0), fp16=True).scale == 128.0
    dyn = build_loss_scaler(OptimConfig(initial_loss_scale=2.0 ** 16, hysteresis=3), fp16=True)
    assert isinstance(dyn, DynamicLossScaler) and dyn.hysteresis_left == 3


def test_fp16_overflow_skips_step_and_backs_off():
    torch.manual_seed(0)
    model = Toy().half()
    ps = single_state()
    grads = DataParallelGrads(model.parameters(), ps)
    scaler = DynamicLossScaler(scale=2.0 ** 15, window=1000, hysteresis=1)
    opt = MixedPrecisionOptimizer(model, OptimConfig(lr=0.1), ps, scaler, fp16=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.tensor([1, 2, 3])
    grads.zero_grad()
    opt.scale_loss(model(x).float() * 1e4).backward()     # fp16 grads overflow to inf
    out = opt.step()
    assert not out.updated and out.found_inf and out.grad_norm is None
    assert scaler.scale == 2.0 ** 14
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    grads.zero_grad()
    opt.scale_loss(model(x).float()).backward()
    out = opt.step()
    assert out.updated and math.isfinite(out.grad_norm)
    assert not torch.equal(before["proj.weight"], model.proj.weight)


def test_fp16_training_logs_skipped_iterations(tmp_path):
    path = str(tmp_path / "m.jsonl")
    cfg = tiny_config(model={"fp16": True}, train={"train_iters": 5},
                      optim={"initial_loss_scale": 2.0 ** 22, "hysteresis": 1},
                      logging={"metrics_jsonl": path})
    result, _ = run_training(cfg)
    rows = read_jsonl(path)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["skipped"] is True and rows[0]["grad_norm"] is None
    assert rows[0]["loss_scale"] == 2.0 ** 21
    scales = [r["loss_scale"] for r in rows]
    assert scales == sorted(scales, reverse=True)          # only backs off here
    assert [r["skipped"] for r in rows] == [r["grad_norm"] is None for r in rows]
    assert rows[-1]["skipped"] is False and rows[-1]["grad_norm"] > 0
    assert result.iteration == 5
    assert all(math.isfinite(r["lm_loss"]) for r in rows)


# -- param groups and master weights -----------------------------------------------------
def test_no_weight_decay_on_norms_and_biases():
    groups = param_groups(list(Toy().named_parameters()), weight_decay=0.1)
    by_wd = {g["weight_decay"]: set(g["names"]) for g in groups}
    assert by_wd[0.1] == {"emb.weight", "proj.weight"}
    assert by_wd[0.0] == {"proj.bias", "norm.weight", "norm.bias"}


def test_bf16_masters_keep_updates_below_bf16_resolution():
    model = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ps = single_state()
    grads = DataParallelGrads(model.parameters(), ps)
    opt = MixedPrecisionOptimizer(model, OptimConfig(optimizer="sgd", lr=1e-3, sgd_momentum=0.0,
                                                     weight_decay=0.0, clip_grad=0.0),
                                  ps, ConstantLossScaler(1.0))
    for _ in range(10):
        grads.zero_grad()
        for _ in range(2):  # two micro-batches accumulate in fp32 main_grad
            model(torch.ones(1, 1, dtype=torch.bfloat16)).sum().mul(0.5).backward()
        assert model.weight.main_grad.dtype == torch.float32
        opt.step()
    assert opt.masters[0].dtype == torch.float32
    assert opt.masters[0].item() == pytest.approx(0.99, abs=1e-6)
    assert model.weight.item() == opt.masters[0].to(torch.bfloat16).item() != 1.0


# -- clipping across tensor parallel ----------------------------------------------------
def _clip_body(rank, world_size):
    with parallel_state(tensor_model_parallel_size=2) as ps:
        g = torch.Generator().manual_seed(7)
        full_w_grad = torch.randn(8, 4, generator=g)
        bias_grad = torch.randn(4, generator=g)
        w = torch.nn.Parameter(torch.zeros(4, 4))
        mark_param(w, init_std=1.0, partition_dim=0)
        b = torch.nn.Parameter(torch.zeros(4))      # replicated on both tp ranks
        w.main_grad = full_w_grad[4 * ps.tp.rank: 4 * ps.tp.rank + 4].clone()
        b.main_grad = bias_grad.clone()
        norm = global_grad_norm([w, b], ps)
        inf_norm = global_grad_norm([w, b], ps, norm_type=math.inf)
        coeff = clip_grads_([w, b], norm / 2, norm)
        clipped = global_grad_norm([w, b], ps)
        return norm, inf_norm, coeff, clipped, full_w_grad, bias_grad


def test_clip_grad_norm_across_tensor_parallel():
    results = run_distributed(2, _clip_body)
    _norm, inf_norm, coeff, _clipped, full_w, bias = results[0]
    expected = math.sqrt(full_w.pow(2).sum().item() + bias.pow(2).sum().item())
    assert all(r[0] == pytest.approx(expected, rel=1e-6) for r in results)
    assert inf_norm == pytest.approx(max(full_w.abs().max().item(), bias.abs().max().item()))
    assert coeff == pytest.approx(0.5, rel=1e-5)
    assert all(r[3] == pytest.approx(expected / 2, rel=1e-5) for r in results)
