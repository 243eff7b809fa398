"""The fp8 weights kept per training step (``megalite.layers.fp8.scaling.StepWeights``)
and the operands quantised straight into the layouts their GEMMs take change no value:
a few optimizer steps of several micro-batches give bit for bit the losses, gradients and
weights of the path that quantises (and transposes) everything at every call, written
out here as ``_Reference``; and each quantisation of a weight runs once per step,
counted as the fp8 tensors of its shape that are written (``tools.bench.fp8.Fp8Writes``)."""

import pytest
import torch

from megalite.layers.fp8 import Fp8Recipe, Fp8Scaling, finish_step, fp8_linear
from megalite.layers.fp8.gemm import scaled_mm
from megalite.layers.fp8.recipes import block_dequantize, block_quantize, quantize
from megalite.layers.fp8.scaling import GRAD, INPUT
from tools.bench.fp8 import Fp8Writes

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
M, K, N = 384, 128, 256      # tokens per micro-batch, in, out: every recipe's blocks tile them
STEPS, MICRO = 3, 3


def _block_mm(a, b, block, a_dtype, b_dtype, mx):
    qa, sa = block_quantize(a, block, a_dtype, mx=mx)
    qb, sb = block_quantize(b, block, b_dtype, mx=mx)
    return block_dequantize(qa, sa) @ block_dequantize(qb, sb).t()


class _Reference(torch.autograd.Function):
    """``x @ w^T`` in fp8 quantising every operand at every call (the weight once per step
    through ``weight_fp8``, as before the step caches) and transposing the fp8 copies
    each GEMM needs."""

    @staticmethod
    def forward(ctx, x, weight, scaling):
        recipe, record = scaling.recipe, scaling.training
        fwd = recipe.forward_dtype
        if recipe.block is not None:
            ctx.save_for_backward(x, weight)
            y = _block_mm(x, weight, recipe.block, fwd, fwd, recipe.recipe == "mxfp8")
        else:
            dx = scaling.scale(INPUT, x, fwd, record)
            dw, qw = scaling.weight_fp8(weight, fwd, record)
            qx = quantize(x, dx, fwd)
            y = scaled_mm(qx, qw, dx, dw, x.dtype)
            ctx.save_for_backward(qx, qw, dx, dw, None if recipe.wgrad else x)
        ctx.scaling, ctx.record = scaling, record
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        scaling = ctx.scaling
        recipe = scaling.recipe
        gdt, fwd = recipe.grad_dtype, recipe.forward_dtype
        if recipe.block is not None:
            x, weight = ctx.saved_tensors
            mx = recipe.recipe == "mxfp8"
            gx = _block_mm(g, weight.t(), recipe.block, gdt, fwd, mx)
            gw = _block_mm(g.t(), x.t(), recipe.block, gdt, fwd, mx) if recipe.wgrad else None
        else:
            qx, qw, dx, dw, x = ctx.saved_tensors
            dg = scaling.scale(GRAD, g, gdt, ctx.record)
            qg = quantize(g, dg, gdt)
            gx = scaled_mm(qg, qw.t().contiguous(), dg, dw, g.dtype)
            gw = (scaled_mm(qg.t().contiguous(), qx.t().contiguous(), dg, dx, g.dtype)
                  if recipe.wgrad else None)
        if not recipe.wgrad:
            gw = g.t().mm(x if recipe.block is None else ctx.saved_tensors[0])
        return gx.to(g.dtype), gw.to(g.dtype), None


class _LocalPS:
    """The groups finish_step reduces over, for one process."""

    tp = dp_cp = None


def _train(recipe: Fp8Recipe, reference: bool, eval_every_step: bool = False):
    """Two fp8 linears (``[N, K]`` then ``[K, N]``) trained ``STEPS`` SGD steps of
    ``MICRO`` micro-batches -> (losses, input gradients, final weights)."""
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(N, K, generator=g) / K ** 0.5).requires_grad_()
    w2 = (torch.randn(K, N, generator=g) / N ** 0.5).requires_grad_()
    model = torch.nn.Module()
    model.s1 = Fp8Scaling(recipe, ((), (), ()))
    model.s2 = Fp8Scaling(recipe, ((), (), ()))

    def forward(x):
        if reference:
            h = _Reference.apply(x, w1, model.s1)
            return _Reference.apply(torch.relu(h), w2, model.s2)
        return fp8_linear(torch.relu(fp8_linear(x, w1, None, model.s1)), w2, None, model.s2)

    losses, grads = [], []
    for _ in range(STEPS):
        for _ in range(MICRO):
            x = torch.randn(M, K, generator=g).requires_grad_()
            target = torch.randn(M, K, generator=g)
            loss = ((forward(x) - target) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
            grads.append(x.grad)
        finish_step([model], _LocalPS())
        with torch.no_grad():
            for w in (w1, w2):
                w -= 0.5 * w.grad
                w.grad = None
        if eval_every_step:           # an evaluation in between: nothing kept, nothing lost
            model.eval()
            with torch.no_grad():
                losses.append(forward(torch.randn(M, K, generator=g)).sum())
            model.train()
    return losses, grads, (w1.detach(), w2.detach())


def _assert_same(a, b):
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert torch.equal(x, y)


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "no-fp8-wgrad"])
@pytest.mark.parametrize("name", RECIPES)
def test_steps_match_the_path_quantising_at_every_call(name, wgrad):
    recipe = Fp8Recipe("hybrid", name, history_len=2, amax_compute_algo="max", wgrad=wgrad)
    ref = _train(recipe, reference=True, eval_every_step=True)
    got = _train(recipe, reference=False, eval_every_step=True)
    assert float(ref[0][0]) != float(ref[0][MICRO + 1])    # the weights did change
    _assert_same(got, ref)


def _writes(recipe: Fp8Recipe, calls: int, training: bool = True):
    """fp8 tensors written per shape over ``calls`` forward + backward of one fp8 linear
    ``[N, K]`` (one step), and the scaling."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g).requires_grad_()
    scaling = Fp8Scaling(recipe, ((), (), ()))
    scaling.train(training)
    with Fp8Writes() as count:
        for _ in range(calls):
            x = torch.randn(M, K, generator=g).requires_grad_()
            fp8_linear(x, w, None, scaling).backward(torch.randn(M, N, generator=g))
    return count.shapes, scaling


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_the_transposed_fp8_weight_is_made_once_per_step(name):
    one, scaling = _writes(Fp8Recipe("hybrid", name), 1)
    three, _ = _writes(Fp8Recipe("hybrid", name), 3)
    assert one[(N, K)] == three[(N, K)] == 1      # the weight's quantisation
    assert one[(K, N)] == three[(K, N)] == 1      # its transposed copy, for dgrad
    assert three[(M, K)] == 3                     # each micro-batch's input
    assert set(scaling._step) == {"fp8", "fp8_t"}
    finish_step([scaling], _LocalPS())
    assert not scaling._step
    # outside training nothing is kept: both made at every call
    evaluation, scaling = _writes(Fp8Recipe("hybrid", name), 3, training=False)
    assert evaluation[(N, K)] == evaluation[(K, N)] == 3 and not scaling._step


def test_a_gathered_fp8_weight_is_transposed_once_per_step():
    """--fp8-param-gather hands the step's fp8 weight to the scaling (once per step;
    handing it again within the step changes nothing); the transposed copy is made once
    from it and forgotten with it."""
    recipe = Fp8Recipe("hybrid", "tensorwise")
    scaling = Fp8Scaling(recipe, ((), (), ()))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(N, K, generator=g)
    d = w.abs().amax() / 448.0
    nan = torch.full((N, K), float("nan")).requires_grad_()   # ZeRO-3's placeholder
    with Fp8Writes() as count:
        for _ in range(3):
            scaling.give_weight(d, quantize(w, d, recipe.forward_dtype))
            x = torch.randn(M, K, generator=g).requires_grad_()
            y = fp8_linear(x, nan, None, scaling)
            y.backward(torch.randn(M, N, generator=g))
            assert torch.isfinite(x.grad).all()
    assert count.shapes[(K, N)] == 1
    assert count.shapes[(N, K)] == 3              # the three gathers' quantisations
    scaling.forget_weight()
    assert not scaling._step and not scaling._given


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "no-fp8-wgrad"])
def test_the_forward_saves_one_fp8_input_already_transposed(wgrad):
    """The forward quantises x once into [M, K] (its GEMM) and [K, M] (wgrad's operand,
    saved: one fp8 copy of x, not two) and, at the step's first forward, the weight into
    [N, K] and its transpose [K, N]; the backward quantises dy once into [M, N] and
    [N, M] and transposes nothing. Under --no-fp8-wgrad no fp8 copy of x is kept, nor
    dy^T made."""
    recipe = Fp8Recipe("hybrid", "tensorwise", wgrad=wgrad)
    scaling = Fp8Scaling(recipe, ((), (), ()))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g).requires_grad_()
    x = torch.randn(M, K, generator=g).requires_grad_()
    with Fp8Writes() as forward:
        y = fp8_linear(x, w, None, scaling)
    fp8_saved = [t for t in y.grad_fn.saved_tensors
                 if t is not None and t.dtype == recipe.forward_dtype and t.numel() == M * K]
    if wgrad:
        assert [tuple(t.shape) for t in fp8_saved] == [(K, M)] and fp8_saved[0].is_contiguous()
        assert torch.equal(fp8_saved[0], quantize(x, scaling.scale(INPUT, x, recipe.forward_dtype,
                                                                   False), recipe.forward_dtype)
                           .t().contiguous())
    else:
        assert fp8_saved == []
    assert forward.shapes == ({(M, K): 1, (K, M): 1, (N, K): 1, (K, N): 1} if wgrad
                              else {(M, K): 1, (N, K): 1, (K, N): 1})
    with Fp8Writes() as backward:
        y.backward(torch.randn(M, N, generator=g))
    assert backward.shapes == ({(M, N): 1, (N, M): 1} if wgrad else {(M, N): 1})


@pytest.mark.parametrize("name", ["mxfp8", "blockwise"])
def test_block_recipes_quantise_the_weight_once_per_step_each_way(name):
    """The weight along K (fprop, [N, K]) and its transpose along N (dgrad, [K, N]): once
    per step, not in every forward and backward; mxfp8's e8m0 scales likewise
    ([N, K / 32], [K, N / 32]); outside training at every call."""
    recipe = Fp8Recipe("hybrid", name)
    b = recipe.block
    one, scaling = _writes(recipe, 1)
    three, _ = _writes(recipe, 3)
    # the values are written as [rows, blocks, block] (then viewed as [rows, columns])
    weight_shapes = [(N, K // b, b), (K, N // b, b)]
    if name == "mxfp8":
        weight_shapes += [(N, K // b), (K, N // b)]
    for shape in weight_shapes:
        assert one[shape] == three[shape] == 1, (shape, three)
    assert three[(M, K // b, b)] == three[(K, M // b, b)] == 3   # x: per micro-batch, GEMM
    assert set(scaling._step) == {"block_k", "block_n"}
    finish_step([scaling], _LocalPS())
    assert not scaling._step
    evaluation, scaling = _writes(recipe, 3, training=False)
    assert all(evaluation[shape] == 3 for shape in weight_shapes) and not scaling._step


# -- the routed experts' grouped GEMMs ------------------------------------------------------
EXPERTS, HIDDEN, FFN = 3, 128, 128


def _experts(name: str):
    import types

    from megalite.config import ModelConfig
    from megalite.moe.experts import GroupedMLP
    from megalite.parallel.state import Group

    cfg = ModelConfig(hidden_size=HIDDEN, num_experts=EXPERTS, moe_router_topk=2,
                      moe_ffn_hidden_size=FFN, swiglu=True, num_layers=2)
    one = types.SimpleNamespace(etp=Group("etp", [0], 0), device=torch.device("cpu"))
    experts = GroupedMLP(cfg, EXPERTS, 0, one, fp8=Fp8Recipe("hybrid", name))
    experts.reset_parameters(7, "layers.1.mlp.experts")
    return experts


def _train_experts(name: str):
    experts = _experts(name)
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 0, 7])
    out = []
    for _ in range(STEPS):
        for _ in range(MICRO):
            x = torch.randn(12, HIDDEN, generator=g).requires_grad_()
            loss = (experts(x, counts) ** 2).mean()
            loss.backward()
            out += [loss.detach(), x.grad]
        finish_step([experts], _LocalPS())
        with torch.no_grad():
            for p in experts.parameters():
                p -= 50.0 * p.grad
                p.grad = None
        experts.eval()                  # an evaluation in between
        with torch.no_grad():
            out.append(experts(torch.randn(12, HIDDEN, generator=g), counts))
        experts.train()
    return out + [p.detach() for p in experts.parameters()]


@pytest.mark.parametrize("name", RECIPES)
def test_expert_steps_match_quantising_the_weights_at_every_call(name, monkeypatch):
    from megalite.layers.fp8.scaling import StepWeights

    got = _train_experts(name)
    monkeypatch.setattr(StepWeights, "step_copy", lambda self, key, record, make: make())
    ref = _train_experts(name)
    assert float(ref[0]) != float(ref[2 * MICRO + 1])    # the weights did change
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("name", RECIPES)
def test_expert_weights_are_quantised_once_per_step(name):
    """fc1 ``[E, h, 2f]`` along h (forward: its transpose ``[E, 2f, h]``) and along 2f
    (input gradient), fc2 ``[E, f, h]`` both ways (``[E, h, f]``, ``[E, f, h]``): each once
    per step over three micro-batches; outside training at every call."""
    experts = _experts(name)
    b = Fp8Recipe("hybrid", name).block
    shapes = {(EXPERTS, 2 * FFN, HIDDEN): 1, (EXPERTS, HIDDEN, 2 * FFN): 1,
              (EXPERTS, HIDDEN, FFN): 2}
    if b is not None:        # values written as [..., blocks, block]
        shapes = {(*s[:-1], s[-1] // b, b): n for s, n in shapes.items()}
    counts = torch.tensor([5, 0, 7])
    for training, calls in ((True, 1), (False, 3)):
        experts.train(training)
        with Fp8Writes() as count:
            for _ in range(3):
                x = torch.randn(12, HIDDEN).requires_grad_()
                experts(x, counts).sum().backward()
        assert {s: count.shapes[s] for s in shapes} == {s: n * calls for s, n in shapes.items()}
        # the tokens (padded to 7 per expert), every micro-batch: fc1's and fc2's inputs
        # (f = h) and fc2's output gradient
        assert count.shapes[(EXPERTS, 7, HIDDEN) if b is None
                            else (EXPERTS, 7, HIDDEN // b, b)] == 3 * 3
        assert bool(experts.fp8_weights._step) == training
        finish_step([experts], _LocalPS())
        assert not experts.fp8_weights._step
