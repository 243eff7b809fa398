"""fp8 GEMMs and Muon on one CUDA GPU against the CPU.

* ``torch._scaled_mm`` on the GPU (the real fp8 kernel, compute capability 8.9+) equals the
  product of the dequantised operands to the accumulator's precision (Hopper's fp8 tensor
  cores add with fewer bits than fp32: 2.8e-4 of the output's scale was measured on an
  H200 at K = 128), also when its epilogue writes bf16;
* the forward GEMM runs that kernel with fast accumulation, the gradient GEMMs without;
* on Hopper (compute capability 9.0, CUDA 12.9+) ``blockwise`` with e4m3 operands runs
  torch's block-scaled kernel, which equals the product of the dequantised blocks, and a
  blockwise e4m3 run follows the CPU's emulated one (whether the kernel takes e5m2 is
  reported);
* an fp8 run on CUDA (per-tensor recipes through that kernel) follows the same fp8 run on
  the CPU, and differs from the fp32 run (the fp8 path ran);
* a compiled fp8 run on CUDA (the fp8 linears inside the layers' graphs) follows the
  eager one;
* Newton-Schulz on CUDA at ``--muon-fp32-matmul-prec medium`` iterates in bf16 and at
  ``high`` in TF32, each within its rounding of the CPU's IEEE fp32 result;
* a Muon run on CUDA follows the CPU's at ``high`` and at ``medium`` (further from the
  CPU, still close).
"""

from __future__ import annotations

import pytest
import torch

from megalite.layers.fp8 import gemm
from megalite.layers.fp8.recipes import (E4M3, E5M2, block_dequantize, block_quantize,
                                         dequant_scale, quantize)
from megalite.optim.newton_schulz import iterate, iteration_dtype, newton_schulz
from tests.gpu.common import CPU, CUDA, config_on
from tests.training.common import run_training

pytestmark = pytest.mark.gpu

ITERS = 8
# fp8 on the CPU and on CUDA quantise the same values unless a summation order moves an
# amax or a value across a rounding boundary. On the CPU this run's fp8 and fp32 curves
# differ by up to 9e-4 over 8 iterations (loss 4.12 -> 3.72); the CUDA fp8 run must differ
# from CUDA fp32 (the fp8 path ran) and stay within 2e-3 of the CPU fp8 run.
FP8_LOSS_ATOL = 2e-3
# blockwise e4m3 (BLOCKWISE below) at this lr moves further: on the CPU the same block
# products summed in another order (each 128-block's partial sum first) move its curve
# 1.5e-3, those partial sums truncated to a 13-bit mantissa (Hopper's fp8 tensor cores add
# within a block with fewer bits than fp32) 5.6e-3 (and the first, forward-only, loss 4.6e-4;
# an H200 gave 4.5e-4 and 3.4e-3 over the curve); fp8 against fp32 is 5.3e-3 there. A
# scale applied to the wrong block is off by O(1) (the kernel test above bounds that).
BLOCK_LOSS_ATOL = 6e-3
MUON_LOSS_ATOL = {"high": 2e-3, "medium": 1e-2}


def _needs_fp8_kernel():
    if torch.cuda.get_device_capability(CUDA) < (8, 9):
        pytest.skip("the fp8 kernel needs compute capability 8.9+ (Ada, Hopper, Blackwell)")


def test_scaled_mm_kernel_equals_its_fp32_emulation():
    _needs_fp8_kernel()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 128, generator=g), torch.randn(48, 128, generator=g)
    da, db = dequant_scale(a.abs().max(), E5M2), dequant_scale(b.abs().max(), E4M3)
    qa, qb = quantize(a, da, E5M2).to(CUDA), quantize(b, db, E4M3).to(CUDA)
    da, db = da.to(CUDA), db.to(CUDA)
    emulated = (qa.float() * da) @ (qb.float() * db).t()
    scale = float(emulated.abs().max())     # ~45: a wrong scale or operand is off by O(1)
    fp32 = gemm.scaled_mm(qa, qb, da, db)
    assert fp32.dtype == torch.float32
    assert float((fp32 - emulated).abs().max()) <= 2e-3 * scale
    out = gemm.scaled_mm(qa, qb, da, db, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - emulated).abs().max()) <= 2e-3 * scale + 2 ** -8 * scale


def _needs_block_kernel():
    _needs_fp8_kernel()
    a = torch.zeros(16, 128, device=CUDA).to(E4M3)
    if not gemm.block_kernel_takes(a, a, 128, False):
        pytest.skip("torch's 1 x 128 block-scaled kernel needs compute capability 9.0, "
                    f"CUDA 12.9+ and torch 2.10+ (here {torch.cuda.get_device_capability()}, "
                    f"CUDA {torch.version.cuda}, torch {torch.__version__})")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_equals_its_fp32_emulation(out_dtype):
    """``blockwise`` on Hopper: torch's block-scaled kernel (fp32 accumulation, each 128
    block's scales applied as it goes) equals the product of the dequantised blocks, with
    outliers that only block scales keep (a per-tensor scale would flush the rest)."""
    _needs_block_kernel()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(256, 512, generator=g), torch.randn(384, 512, generator=g) * 1e-3
    a[:, 7] *= 1e4
    qa, sa = block_quantize(a.to(CUDA), 128, E4M3, mx=False)
    qb, sb = block_quantize(b.to(CUDA), 128, E4M3, mx=False)
    # on the CPU: IEEE fp32 whatever the GPU's fp32 matmul precision is set to
    emulated = block_dequantize(qa.cpu(), sa.cpu()) @ block_dequantize(qb.cpu(), sb.cpu()).t()
    calls = []
    real = gemm.BLOCK_SCALED_MM

    def counted(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    gemm.BLOCK_SCALED_MM = counted
    try:
        out = gemm.block_mm(qa, sa, qb, sb, out_dtype, False)
    finally:
        gemm.BLOCK_SCALED_MM = real
    assert len(calls) == 1 and out.dtype == out_dtype
    scale = float(emulated.abs().max())
    rounding = 2 ** -8 * scale if out_dtype == torch.bfloat16 else 0.0
    # the bound of test_scaled_mm_kernel_equals_its_fp32_emulation (the tensor cores add
    # within a block with fewer bits than fp32); a scale applied to the wrong block is off
    # by O(1) of the scale here, where one column is 1e4 times the rest
    assert float((out.cpu().float() - emulated).abs().max()) <= 2e-3 * scale + rounding


def test_block_kernel_with_e5m2_gradients_is_reported():
    """Whether cuBLAS's 1 x 128 kernel takes an e5m2 operand (``hybrid``'s gradients, kept
    emulated by block_kernel_takes until seen): skipped with the kernel's own message
    where it refuses, checked against the emulation where it takes it."""
    _needs_block_kernel()
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(256, 256, generator=g), torch.randn(128, 256, generator=g)
    qa, sa = block_quantize(a.to(CUDA), 128, E5M2, mx=False)
    qb, sb = block_quantize(b.to(CUDA), 128, E4M3, mx=False)
    one_by = torch.nn.functional.ScalingType.BlockWise1x128
    try:
        out = gemm.BLOCK_SCALED_MM(qa, qb.t(), sa.t().contiguous().t(), one_by,
                                   sb.t().contiguous().t(), one_by, output_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"e5m2 x e4m3 refused: {str(exc).splitlines()[0][:200]}")
    emulated = block_dequantize(qa.cpu(), sa.cpu()) @ block_dequantize(qb.cpu(), sb.cpu()).t()
    scale = float(emulated.abs().max())
    assert float((out.cpu() - emulated).abs().max()) <= 2e-3 * scale


# the e4m3 format: the one whose GEMMs all go to the block kernel
BLOCKWISE = {"fp8_recipe": "blockwise", "fp8_format": "e4m3", "hidden_size": 128,
             "seq_length": 64}


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_on_cuda_follows_cpu(monkeypatch, recipe):
    _needs_block_kernel() if recipe == "blockwise" else _needs_fp8_kernel()
    calls = []
    name = "BLOCK_SCALED_MM" if recipe == "blockwise" else "SCALED_MM"
    real = getattr(gemm, name)

    def counted(a, *args, **kwargs):
        calls.append(a.device.type)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(gemm, name, counted)
    fp8 = {"fp8_format": "hybrid", "fp8_recipe": recipe,
           **(BLOCKWISE if recipe == "blockwise" else {})}
    train = {"train_iters": ITERS}
    ref, _ = run_training(config_on(CPU, model=fp8, train=train))
    calls.clear()
    cuda, _ = run_training(config_on(CUDA, model=fp8, train=train))
    plain, _ = run_training(config_on(CUDA, model={k: v for k, v in fp8.items()
                                                   if not k.startswith("fp8")}, train=train))
    assert calls and set(calls) == {"cuda"}   # the GPU kernel ran every fp8 GEMM
    assert list(cuda.losses) == list(ref.losses) == list(range(1, ITERS + 1))
    worst = max(abs(cuda.losses[i] - ref.losses[i]) for i in ref.losses)
    bound = BLOCK_LOSS_ATOL if recipe == "blockwise" else FP8_LOSS_ATOL
    assert worst <= bound, (worst, cuda.losses, ref.losses)
    assert max(abs(cuda.losses[i] - plain.losses[i]) for i in ref.losses) > 1e-4


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_compiled_fp8_follows_eager_fp8_on_cuda(recipe):
    """``--compile`` traces the fp8 linears, their quantisations and ``torch._scaled_mm``
    into the layers' graphs (no graph break), which inductor compiles for the GPU: the
    curve stays within the CPU-to-CUDA bound of the eager fp8 run's."""
    from torch._dynamo.utils import counters

    _needs_fp8_kernel()
    fp8 = {"fp8_format": "hybrid", "fp8_recipe": recipe}
    eager, _ = run_training(config_on(CUDA, model=fp8, train={"train_iters": ITERS}))
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = run_training(config_on(CUDA, model=fp8,
                                         train={"train_iters": ITERS, "compile": True}))
    assert dict(counters["graph_break"]) == {}
    assert list(compiled.losses) == list(eager.losses) == list(range(1, ITERS + 1))
    worst = max(abs(compiled.losses[i] - eager.losses[i]) for i in eager.losses)
    assert worst <= FP8_LOSS_ATOL, (worst, compiled.losses, eager.losses)


@pytest.mark.parametrize("precision,dtype,bound", [("high", torch.float32, 5e-3),
                                                   ("medium", torch.bfloat16, 1.5e-2)])
def test_newton_schulz_precision_on_cuda(precision, dtype, bound):
    """The iteration's matmul dtype on CUDA for each ``--muon-fp32-matmul-prec`` (bf16 at
    medium, as Megatron-LM runs it; the CPU's bf16 iteration is 6e-3 from fp32 at this
    shape), each result within its rounding of the CPU's IEEE fp32 one; torch's global
    matmul precision is left as it was."""
    x = torch.randn(4, 256, 704, generator=torch.Generator().manual_seed(3))
    exact = iterate(x, 5, "quintic")
    assert iteration_dtype(x.to(CUDA), precision) == dtype
    before = torch.get_float32_matmul_precision()
    got = newton_schulz(x.to(CUDA), 5, "quintic", precision=precision).cpu()
    assert torch.get_float32_matmul_precision() == before
    assert got.dtype == torch.float32
    rel = (got - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))
    assert rel.max() < bound, rel


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_muon_on_cuda_follows_cpu(precision):
    optim = {"optimizer": "muon", "muon_fp32_matmul_prec": precision}
    train = {"train_iters": ITERS}
    ref, _ = run_training(config_on(CPU, optim=optim, train=train))
    cuda, c = run_training(config_on(CUDA, optim=optim, train=train))
    assert c.ps.device == CUDA
    assert list(cuda.losses) == list(ref.losses) == list(range(1, ITERS + 1))
    atol = MUON_LOSS_ATOL[precision]
    assert ref.losses[1] - ref.losses[ITERS] > 10 * atol   # it learns (0.43 here)
    worst = max(abs(cuda.losses[i] - ref.losses[i]) for i in ref.losses)
    assert worst <= atol, (worst, cuda.losses, ref.losses)


def test_the_forward_gemm_uses_fast_accumulation(monkeypatch):
    """fprop runs the kernel with use_fast_accum (gemm.FPROP_FAST_ACCUM), dgrad and wgrad
    without; the fast-accumulated output stays the dequantised product to the bound of
    test_scaled_mm_kernel_equals_its_fp32_emulation."""
    from megalite.layers.fp8 import Fp8Recipe, Fp8Scaling, fp8_linear

    _needs_fp8_kernel()
    assert gemm.FPROP_FAST_ACCUM
    modes = []
    real = gemm.SCALED_MM

    def recorded(*args):     # (a, b, scale_a, scale_b, bias, scale_result, out_dtype, fast)
        modes.append(args[7])
        return real(*args)

    monkeypatch.setattr(gemm, "SCALED_MM", recorded)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=g).to(CUDA).requires_grad_()
    w = (torch.randn(48, 128, generator=g) * 0.05).to(CUDA).requires_grad_()
    scaling = Fp8Scaling(Fp8Recipe("hybrid", "tensorwise"), ((), (), ()), device=CUDA)
    y = fp8_linear(x, w, None, scaling)
    y.backward(torch.randn(64, 48, generator=g).to(CUDA))
    assert modes == [True, False, False]       # fprop, dgrad, wgrad
    dx = dequant_scale(x.detach().abs().max(), E4M3)
    dw = dequant_scale(w.detach().abs().max(), E4M3)
    emulated = ((quantize(x.detach(), dx, E4M3).float() * dx)
                @ (quantize(w.detach(), dw, E4M3).float() * dw).t())
    scale = float(emulated.abs().max())
    assert float((y.detach() - emulated).abs().max()) <= 2e-3 * scale
