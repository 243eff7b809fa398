"""The output layer's projection into reused storage: the same logits and gradients as
``F.linear`` bit for bit, storage handed out again only when nothing holds it, and the
plain ``F.linear`` wherever the reuse does not apply."""

import torch
import torch.nn.functional as F

from megalite.layers.linear import ColumnParallelLinear, _project
from megalite.layers.reused_buffer import ReusedGradBuffer
from tests.model.common import single_process_state


def _inputs(seed, s=6, b=3, h=8, v=40):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, h, generator=g), torch.randn(v, h, generator=g), \
        torch.randn(s, b, v, generator=g)


def _reference(x, w, up):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = F.linear(x, w)
    y.backward(up)
    return y.detach(), x.grad, w.grad


def test_logits_and_gradients_bitwise_equal_to_linear():
    buffers = (ReusedGradBuffer(), ReusedGradBuffer())
    for seed in (0, 1, 2):
        x0, w0, up = _inputs(seed)
        want_y, want_dx, want_dw = _reference(x0, w0, up)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = _project(x, w, None, buffers)
        assert torch.equal(y, want_y)
        y.backward(up)
        assert torch.equal(x.grad, want_dx) and torch.equal(w.grad, want_dw)


def test_storage_reused_only_once_released():
    buffers = (ReusedGradBuffer(), ReusedGradBuffer())
    x, w, up = _inputs(0)
    w = w.requires_grad_(True)
    y = _project(x, w, None, buffers)
    first = y.data_ptr()
    held = _project(x, w, None, buffers)          # y still alive: fresh storage
    assert held.data_ptr() != first and torch.equal(held, y)
    del y
    again = _project(x, w, None, buffers)         # the first storage is free again
    assert again.data_ptr() == first
    again.backward(up)
    grad_ptr, kept = w.grad.data_ptr(), w.grad.clone()
    _project(x, w, None, buffers).backward(up)   # w.grad kept (accumulation): not reused
    assert torch.equal(w.grad, kept * 2) and w.grad.data_ptr() == grad_ptr
    w.grad = None
    _project(x, w, None, buffers).backward(up)
    assert torch.equal(w.grad, kept)


def test_tied_weight_gets_both_gradients():
    """The tied output layer: one weight used by the embedding and the projection."""
    x0, w0, up = _inputs(3, v=40)
    ids = torch.randint(0, 40, (6, 3), generator=torch.Generator().manual_seed(4))
    want = w0.clone().requires_grad_(True)
    (F.linear(F.embedding(ids, want) + x0, want) * up).sum().backward()
    got = w0.clone().requires_grad_(True)
    buffers = (ReusedGradBuffer(), ReusedGradBuffer())
    (_project(F.embedding(ids, got) + x0, got, None, buffers) * up).sum().backward()
    assert torch.equal(got.grad, want.grad)


def test_plain_linear_where_reuse_does_not_apply():
    buffers = (ReusedGradBuffer(), ReusedGradBuffer())
    x, w, _ = _inputs(0)
    bias = torch.zeros(w.shape[0])
    for args in ((x, w, bias, buffers), (x.bfloat16(), w.bfloat16(), None, buffers),
                 (x, w, None, None)):
        y = _project(*args)
        assert y.grad_fn is None or "Projection" not in type(y.grad_fn).__name__
        assert torch.equal(y, F.linear(*args[:3]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _project(x, w, None, buffers).dtype == torch.bfloat16
    assert buffers[0]._storage is None


def test_output_layer_keeps_its_buffers():
    ps = single_process_state()
    layer = ColumnParallelLinear(8, 40, bias=False, ps=ps, reuse_buffers=True)
    torch.nn.init.normal_(layer.weight)
    x, _, up = _inputs(5)
    layer(x).backward(up)
    want = _reference(x, layer.weight.detach(), up)[2]
    assert torch.equal(layer.weight.grad, want)
    assert layer._reused[1]._storage is not None
    assert ColumnParallelLinear(8, 40, bias=False, ps=ps)._reused is None
