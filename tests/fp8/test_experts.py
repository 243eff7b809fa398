"""The routed experts' grouped GEMMs in fp8 (``megalite.moe.fp8_experts``): per-row and
per-block scales make a token's result independent of which other tokens share its
expert's GEMM (the property layout invariance needs: the tokens an expert multiplies at
once depend on ep and dp), the products stay within the formats' error of fp32, and the
weight gradient is the training precision's ``x^T dy``."""

import pytest
import torch

from megalite.layers.fp8 import Fp8Recipe
from megalite.moe.experts import grouped_mlp
from megalite.moe.fp8_experts import fp8_expert_bmm

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
E, H, F = 3, 128, 128          # experts, hidden, ffn: every recipe's blocks tile them


def _operands(seed: int = 0, outlier: bool = True):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(int(counts.sum()), H, generator=g)
    if outlier:   # one token 1000x larger than the rest of its expert's
        x[2] *= 1000.0
    fc1 = torch.randn(E, H, 2 * F, generator=g) * 0.05
    fc2 = torch.randn(E, F, H, generator=g) * 0.05
    return counts, x, fc1, fc2


def _row_errors(a, b):
    """Each row's relative difference (norm of the difference over the row's norm)."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def _mlp(x, counts, fc1, fc2, recipe):
    return grouped_mlp(x, counts, fc1, fc2, swiglu=True, fp8=recipe)


@pytest.mark.parametrize("name", RECIPES)
def test_a_tokens_result_does_not_depend_on_the_other_tokens(name):
    """Expert 0's tokens in one GEMM, or split in two GEMMs (as when two data-parallel
    ranks' micro-batches reach the expert apart): the same rows, forward and input
    gradient; the outlier token does not coarsen the others' scales. (Not bit for bit: the
    GEMMs' fp32 sums may run in another order for another number of rows, which can move
    a value of the hidden layer across an fp8 rounding boundary; a shared per-tensor
    scale would be off by about 100% on these rows.)"""
    recipe = Fp8Recipe("hybrid", name)
    counts, x, fc1, fc2 = _operands()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    x = x.requires_grad_(True)
    together = _mlp(x, counts, fc1, fc2, recipe)
    (dx_together,) = torch.autograd.grad(together, x, dy)
    first, rest = x[:3], x[3:]     # expert 0: tokens 0-2 | tokens 3-4, then expert 2's
    apart = torch.cat([_mlp(first, torch.tensor([3, 0, 0]), fc1, fc2, recipe),
                       _mlp(rest, torch.tensor([2, 0, 7]), fc1, fc2, recipe)])
    (dx_apart,) = torch.autograd.grad(apart, x, dy)
    assert _row_errors(apart, together) < 1e-3
    assert _row_errors(dx_apart, dx_together) < 1e-3


def test_a_per_tensor_scale_would_depend_on_them():
    """The contrast that makes the test above able to fail: one scale for the expert's
    whole input, taken with and without the outlier token, changes the other rows."""
    from megalite.layers.fp8.recipes import E4M3, dequant_scale, quantize

    _, x, _, _ = _operands()
    rows = x[3:5]
    alone = quantize(rows, dequant_scale(rows.abs().amax(), E4M3), E4M3).float()
    with_outlier = quantize(rows, dequant_scale(x[:5].abs().amax(), E4M3), E4M3).float()
    assert not torch.equal(alone * dequant_scale(rows.abs().amax(), E4M3),
                           with_outlier * dequant_scale(x[:5].abs().amax(), E4M3))


@pytest.mark.parametrize("name", RECIPES)
def test_products_are_within_fp8_error_and_wgrad_is_exact(name):
    recipe = Fp8Recipe("hybrid", name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(E, 16, H, generator=g).requires_grad_(True)
    w = (torch.randn(E, H, F, generator=g) * 0.05).requires_grad_(True)
    dy = torch.randn(E, 16, F, generator=g)
    y = fp8_expert_bmm(x, w, recipe, split_in=False, split_out=False, etp_group=None)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    y, ref = y.detach(), torch.bmm(x, w).detach()
    assert float((y - ref).norm() / ref.norm()) < 0.05            # e4m3 operands
    ref_dx = torch.bmm(dy, w.transpose(1, 2))
    assert float((dx - ref_dx).norm() / ref_dx.norm()) < 0.08     # e5m2 gradient
    assert float((dx - ref_dx).norm() / ref_dx.norm()) > 0        # it is fp8, not fp32
    assert torch.equal(dw, x.transpose(1, 2).bmm(dy))              # training precision


def test_moe_layer_runs_its_experts_in_fp8_and_keeps_bf16_layers():
    from megalite.config import ModelConfig, ParallelConfig
    from megalite.moe.layer import MoELayer
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig())
    kw = dict(hidden_size=32, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
              swiglu=True, num_layers=3, fp8_format="hybrid", fp8_recipe="tensorwise",
              first_last_layers_bf16=True)
    cfg = ModelConfig(**kw)
    assert MoELayer(cfg, ps, layer_number=1, seed=1).experts.fp8 is not None
    assert MoELayer(cfg, ps, layer_number=0, seed=1).experts.fp8 is None
    assert MoELayer(cfg, ps, layer_number=2, seed=1).experts.fp8 is None


def test_tiling_checks_the_experts_per_etp_rank():
    from megalite.config import ConfigError, ModelConfig

    cfg = ModelConfig(hidden_size=64, num_experts=4, moe_router_topk=2, num_layers=2,
                      moe_ffn_hidden_size=96, fp8_format="e4m3", fp8_recipe="mxfp8",
                      seq_length=64, moe_layer_freq=1)
    cfg.check_fp8_tiling(1, 1, 1)   # 96 = 3 x 32; the dense MLP (none here) is not asked
    with pytest.raises(ConfigError, match="the experts' fc1 output per etp rank is 48"):
        cfg.check_fp8_tiling(1, 1, 1, etp=2)


def _etp_body(rank, world_size, name):
    """fp8 experts at etp 2 (partial sums over the ranks) against etp 1, same weights."""
    import types

    from megalite.config import ModelConfig, ParallelConfig
    from megalite.moe.experts import GroupedMLP
    from megalite.parallel import collectives as C
    from megalite.parallel.state import Group, ParallelState

    cfg = ModelConfig(hidden_size=H, num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=F,
                      swiglu=True, num_layers=2)
    recipe = Fp8Recipe("hybrid", name)
    ps = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2))
    one = types.SimpleNamespace(etp=Group("etp", [rank], 0), device=torch.device("cpu"))
    counts, x, _, _ = _operands()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    outs = []
    for state in (one, ps):
        experts = GroupedMLP(cfg, E, 0, state, fp8=recipe)
        experts.reset_parameters(7, "layers.1.mlp.experts")
        xi = x.clone().requires_grad_(True)
        y = experts(xi, counts)
        (dx,) = torch.autograd.grad(y, xi, dy)
        y = y.detach().contiguous()
        if state is ps:   # the etp ranks' partial sums (the dispatcher's reduction)
            C.all_reduce(y, ps.etp)
            C.all_reduce(dx, ps.etp)
        outs.append((y, dx))
    return _row_errors(outs[1][0], outs[0][0]), _row_errors(outs[1][1], outs[0][1])


@pytest.mark.parametrize("name", ["tensorwise", "mxfp8"])
def test_expert_tensor_parallel_gives_the_unsplit_result(name):
    """A row's amax over a contraction split by etp (fc2 forward, fc1 input gradient) is
    the maximum over both ranks, so etp 2 gives etp 1's rows up to fp32 summation order
    (a rank-local amax gives errors of the order of fp8's rounding, 1e-2)."""
    from tests.distributed.harness import run_distributed

    for y_err, dx_err in run_distributed(2, _etp_body, name):
        assert y_err < 1e-4 and dx_err < 1e-4, (y_err, dx_err)
