"""The fp8 GEMMs of each recipe against fp32: every product of a linear (forward, input
gradient, weight gradient) within a bound set by the format's precision, for random
inputs and for inputs with outliers; the kernel path against its emulation; the MX
scales as the OCP rule gives them."""

import pytest
import torch

from megalite.layers.fp8 import Fp8Recipe, Fp8Scaling, fp8_linear
from megalite.layers.fp8.gemm import scaled_mm
from megalite.layers.fp8.recipes import (E4M3, E5M2, FP8_MAX, block_dequantize,
                                         block_quantize, dequant_scale, quantize)

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
# relative Frobenius error of one GEMM whose operands are rounded to 3 (e4m3) or 2 (e5m2)
# mantissa bits: each operand is off by at most 2^-4 (2^-3) relative, about a third of
# that on average (random inputs give 0.036-0.043 with e4m3, 0.057-0.063 with e5m2)
BOUND = {E4M3: 0.05, E5M2: 0.08}
# with outliers a few products dominate the result, so the rounding errors no longer
# average out (worst seen: 0.065 e4m3, 0.103 e5m2)
OUTLIER_FACTOR = 1.75


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _operands(outliers: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 128, generator=g)       # [M tokens, K in]
    w = torch.randn(128, 128, generator=g) * 0.05  # [N out, K in]
    dy = torch.randn(256, 128, generator=g) * 1e-3
    if outliers:   # a few channels 1000x larger (LLM activation outliers)
        x[:, 5] *= 1000.0
        x[7, :] *= 300.0
        dy[:, 3] *= 1000.0
    return x, w, dy


def _run(recipe: Fp8Recipe, x, w, dy, history=None):
    scaling = Fp8Scaling(recipe, ((), (), ()))
    if history is not None:
        scaling.amax_history[:, 0] = history
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    y = fp8_linear(x, w, None, scaling)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outliers"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("name", RECIPES)
def test_each_gemm_is_close_to_fp32(name, fmt, outliers):
    x, w, dy = _operands(outliers)
    recipe = Fp8Recipe(fmt, name)
    history = None
    if name == "delayed":   # a history that holds these tensors' amaxes (as after a step)
        history = torch.stack([x.abs().max(), w.abs().max(), dy.abs().max()])
    y, gx, gw = _run(recipe, x, w, dy, history)
    gdt = E5M2 if fmt == "hybrid" else E4M3
    loose = OUTLIER_FACTOR if outliers else 1.0
    assert _rel(y, x @ w.t()) < BOUND[E4M3] * loose
    assert _rel(gx, dy @ w) < BOUND[gdt] * loose
    assert _rel(gw, dy.t() @ x) < BOUND[gdt] * loose


def test_block_scales_beat_tensor_scales_on_extreme_outliers():
    """One entry 1e5 times the rest: a per-tensor scale flushes the others to subnormals
    (an error past 10%); 32-element blocks leave them their own scales."""
    x, w, dy = _operands(False)
    x[0, 0] = 1e5
    ref = x @ w.t()
    mask = torch.ones_like(ref, dtype=torch.bool)
    mask[0] = False                      # rows without the outlier
    errs = {}
    for name in ("tensorwise", "mxfp8", "blockwise"):
        y, _, _ = _run(Fp8Recipe("e4m3", name), x, w, dy)
        errs[name] = _rel(y[mask], ref[mask])
    assert errs["tensorwise"] > 0.1, errs
    assert errs["mxfp8"] < BOUND[E4M3] and errs["blockwise"] < BOUND[E4M3], errs


def test_scaled_mm_equals_its_fp32_emulation():
    """torch._scaled_mm (fp32 out) is the fp32 product of the dequantised operands."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(48, 96, generator=g), torch.randn(32, 96, generator=g)
    da, db = dequant_scale(a.abs().max(), E4M3), dequant_scale(b.abs().max(), E5M2)
    qa, qb = quantize(a, da, E4M3), quantize(b, db, E5M2)
    assert float(qa.float().abs().max()) == FP8_MAX[E4M3]   # the range is used in full
    emulated = (qa.float() * da) @ (qb.float() * db).t()
    torch.testing.assert_close(scaled_mm(qa, qb, da, db), emulated, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["mxfp8", "blockwise"])
def test_block_gemms_go_to_the_block_kernel_in_its_layouts(monkeypatch, name):
    """Where torch's block-scaled kernel runs (1 x 128 fp32 scales on a Hopper GPU), each of
    a blockwise linear's three GEMMs calls it with ``a`` row-major, ``b`` column-major and
    both scales ``[rows, K / 128]`` outer-dimension-major, as cuBLAS reads them. A stand-in
    kernel checks those layouts and multiplies what it was given: the results are the
    emulation's, bit for bit (``tests/gpu`` checks the real kernel). mxfp8 never calls
    it (its kernel is not for this GPU and takes other scales)."""
    from megalite.layers.fp8 import gemm

    x, w, dy = _operands(False)
    x, w = torch.cat([x, x], 1), torch.cat([w, w], 1)        # K = 256: two blocks of 128
    recipe = Fp8Recipe("e4m3", name)
    emulated = _run(recipe, x, w, dy)
    calls = []

    def kernel(a, b, sa, recipe_a, sb, recipe_b, output_dtype):
        (m, k), n = a.shape, b.shape[1]
        one_by = torch.nn.functional.ScalingType.BlockWise1x128
        assert recipe_a == recipe_b == one_by and b.shape[0] == k
        assert a.dtype in (E4M3, E5M2) and b.dtype in (E4M3, E5M2)
        assert a.stride() == (k, 1) and b.stride() == (1, k)
        for s, rows in ((sa, m), (sb, n)):     # a single column's stride does not matter
            assert s.shape == (rows, k // 128) and s.dtype == torch.float32
            assert s.stride(0) == 1 and (k == 128 or s.stride(1) == rows)
        calls.append((m, n, k, a.dtype, b.dtype))
        return (block_dequantize(a, sa) @ block_dequantize(b.t(), sb).t()).to(output_dtype)

    monkeypatch.setattr(gemm, "BLOCK_SCALED_MM", kernel)
    monkeypatch.setattr(gemm, "block_kernel_takes", lambda a, b, block, mx: block == 128)
    # (on a GPU the kernel also wants e4m3 operands: the e4m3 format, as DeepSeek-V3 runs)
    got = _run(recipe, x, w, dy)
    for a, b in zip(got, emulated):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if name == "mxfp8":
        assert calls == []
    else:   # fprop over K, dgrad over N (dy, w^T), wgrad over the 256 tokens (dy^T, x^T)
        assert calls == [(256, 128, 256, E4M3, E4M3), (256, 256, 128, E4M3, E4M3),
                         (128, 256, 256, E4M3, E4M3)]


def test_the_block_kernel_is_not_taken_on_the_cpu_nor_for_mx_scales_nor_e5m2(monkeypatch):
    from megalite.layers.fp8 import gemm

    a = torch.zeros(256, 256).to(E4M3)
    assert not gemm.block_kernel_takes(a, a, 128, False)
    assert not gemm.block_kernel_takes(a, a, 32, True)
    # as if on a Hopper GPU: e4m3 operands only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gemm, "_cuda_version", lambda: (12, 9))
    fake = type("FakeCuda", (), {"device": torch.device("cuda"), "shape": (256, 256),
                                 "dtype": E4M3})
    e5m2 = type("FakeCuda", (), {"device": torch.device("cuda"), "shape": (256, 256),
                                 "dtype": E5M2})
    assert gemm.block_kernel_takes(fake, fake, 128, False)
    assert not gemm.block_kernel_takes(e5m2, fake, 128, False)
    assert not gemm.block_kernel_takes(fake, fake, 32, True)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mx_scales_follow_the_ocp_rule(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-3, 3, 64)
    q, scales = block_quantize(x, 32, dtype, mx=True)
    assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (4, 2)
    amax = x.reshape(4, 2, 32).abs().amax(-1)
    emax = 8 if dtype == E4M3 else 15
    want = torch.exp2(torch.floor(torch.log2(amax)) - emax)
    torch.testing.assert_close(scales.float(), want, rtol=0, atol=0)
    # largest element of each block: amax / scale in [2^emax, 2^(emax+1)), saturated at max
    top = (q.float().reshape(4, 2, 32).abs().amax(-1))
    assert bool((top >= 2.0 ** emax).all()) and bool((top <= FP8_MAX[dtype]).all())
    back = block_dequantize(q, scales)
    assert _rel(back, x) < BOUND[dtype]


def test_untileable_block_dimension_is_one_error():
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        block_quantize(torch.randn(4, 40), 32, E4M3, mx=True)


def test_delayed_scale_comes_from_the_history_not_the_tensor():
    """Delayed scaling quantises with the history's amax: a history 4x the tensor's amax
    uses a quarter of the range; training records the tensor's amax for the step."""
    recipe = Fp8Recipe("e4m3", "delayed", history_len=3, amax_compute_algo="max")
    scaling = Fp8Scaling(recipe, ((), (), ()))
    x = torch.randn(16, 32)
    scaling.amax_history[0] = torch.tensor([1.0, 4 * float(x.abs().max()), 2.0])
    d = scaling.scale(0, x, E4M3, record=True)
    assert float(d) == pytest.approx(4 * float(x.abs().max()) / 448.0)
    assert float(scaling.step_amax[0]) == float(x.abs().max())
    scaling.push(scaling.step_amax.clone())
    assert float(scaling.amax_history[0, 0]) == float(x.abs().max())
    assert float(scaling.amax_history[0, 1]) == 1.0 and float(scaling.step_amax.sum()) == 0


@pytest.mark.parametrize("lengths", [(3, 3, 3), (3, 1, 3)], ids=["stacked", "one-by-one"])
def test_pushing_all_histories_at_once_equals_pushing_each(lengths):
    """The end of a delayed step pushes every linear's amaxes in a few stacked kernels:
    the histories and cleared step maxima of pushing them one by one (also where the
    histories' lengths differ and they are pushed one by one)."""
    from megalite.layers.fp8.scaling import push_all

    g = torch.Generator().manual_seed(5)
    amax = torch.rand(len(lengths), 3, generator=g)

    def scalings():
        out = []
        for i, n in enumerate(lengths):
            s = Fp8Scaling(Fp8Recipe("hybrid", "delayed", history_len=n), ((), (), ()))
            s.amax_history.copy_(torch.arange(3 * n, dtype=torch.float32).view(3, n) + i)
            s.step_amax.fill_(7.0)
            s.step_copy("fp8", True, lambda: "a step's copy")
            out.append(s)
        return out

    one, every = scalings(), scalings()
    for s, a in zip(one, amax):
        s.push(a)
    push_all(every, amax)
    for a, b in zip(one, every):
        torch.testing.assert_close(b.amax_history, a.amax_history, rtol=0, atol=0)
        assert float(b.step_amax.abs().sum()) == 0 and b._step == {}
    assert float(every[0].amax_history[1, 0]) == float(amax[0, 1])
    assert float(every[0].amax_history[1, 1]) == 3.0        # the old newest, shifted


@pytest.mark.parametrize("name", RECIPES)
def test_no_fp8_wgrad_keeps_the_weight_gradient_in_the_training_precision(name):
    """--no-fp8-wgrad: dw is dy^T x of the unquantised operands (fp32 here, exactly),
    while the forward and input-gradient GEMMs stay in fp8."""
    x, w, dy = _operands(False)
    y, gx, gw = _run(Fp8Recipe("hybrid", name, wgrad=False), x, w, dy)
    fp8_y, fp8_gx, fp8_gw = _run(Fp8Recipe("hybrid", name), x, w, dy)
    torch.testing.assert_close(gw, dy.t() @ x, rtol=1e-6, atol=1e-6)
    assert _rel(fp8_gw, dy.t() @ x) > 1e-2
    assert torch.equal(y, fp8_y) and torch.equal(gx, fp8_gx)


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_the_weight_is_quantised_once_per_training_step(name):
    """Every micro-batch of a step multiplies the same fp8 copy of the weight (the step's,
    which backward takes again: not one per micro-batch, none saved with the activations);
    finish_step forgets it before the optimizer changes the weight; outside training each
    call quantises afresh and saves its copy for its backward."""
    from megalite.layers.fp8.scaling import finish_step

    scaling = Fp8Scaling(Fp8Recipe("hybrid", name), ((), (), ()))
    x, w, _ = _operands(False)
    w = w.clone().requires_grad_()
    ys, copies = [], []
    for i in range(2):
        ys.append(fp8_linear(x[i::2].clone().requires_grad_(), w, None, scaling))
        copies.append(scaling._step["fp8"][1])
    assert copies[0] is copies[1]
    for y in ys:   # (qx^T, dx, x, weight, qw, dw, qw^T): the step's transposed copy only
        saved = y.grad_fn.saved_tensors
        assert saved[3] is None and saved[4] is None and saved[6] is scaling._step["fp8_t"]
    with torch.no_grad():
        w.mul_(2.0)                                       # the optimizer's update
    model = torch.nn.Module()
    model.scaling = scaling
    finish_step([model], None if name == "tensorwise" else _LocalPS())
    assert "fp8" not in scaling._step
    y = fp8_linear(x.clone().requires_grad_(), w, None, scaling)
    assert scaling._step["fp8"][1] is not copies[0]
    ref = _run(Fp8Recipe("hybrid", name), x, w.detach(),
               torch.zeros(x.shape[0], w.shape[0]), history=scaling.amax_history[:, 0]
               if name == "delayed" else None)[0]
    torch.testing.assert_close(y.detach(), ref, rtol=0, atol=0)
    scaling.eval()
    a = fp8_linear(x, w, None, scaling).grad_fn.saved_tensors[4]
    b = fp8_linear(x, w, None, scaling).grad_fn.saved_tensors[4]
    assert a.data_ptr() != b.data_ptr()


class _LocalPS:
    """The groups finish_step reduces over, for one process."""

    tp = dp_cp = None
