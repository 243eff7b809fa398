"""The embedding lookup's reused gradient buffer: the same gradient as ``F.embedding``,
bit for bit, and its storage handed out again only when nothing else holds it."""

import torch
import torch.nn.functional as F

from megalite.layers.embedding import ReusedGradBuffer, VocabParallelEmbedding, embedding_lookup
from tests.model.common import single_process_state


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (9, 3), generator=g)  # many repeated ids: summation order
    ids[0, 0] = ids[1, 0] = ids[2, 1] = 6
    return ids, torch.randn(9, 3, 5, generator=g) * 1e3


def _reference_grad(table, ids, up):
    w = table.clone().requires_grad_(True)
    F.embedding(ids, w).backward(up)
    return w.grad


def test_lookup_values_and_gradient_bitwise():
    table = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    buffer = ReusedGradBuffer()
    w = table.clone().requires_grad_(True)
    for seed in (1, 2, 3):
        ids, up = _case(seed)
        out = embedding_lookup(ids, w, buffer)
        assert torch.equal(out, F.embedding(ids, table))
        out.backward(up)
        assert torch.equal(w.grad, _reference_grad(table, ids, up))
        w.grad = None


def test_buffer_reused_only_when_released():
    table = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    buffer, w = ReusedGradBuffer(), table.clone().requires_grad_(True)
    ids1, up1 = _case(1)
    ids2, up2 = _case(2)
    embedding_lookup(ids1, w, buffer).backward(up1)
    first = w.grad.data_ptr()
    # the gradient is kept (accumulation): the next backward must not write into it
    embedding_lookup(ids2, w, buffer).backward(up2)
    want = _reference_grad(table, ids1, up1) + _reference_grad(table, ids2, up2)
    assert torch.equal(w.grad, want)
    assert w.grad.data_ptr() == first
    w.grad = None
    embedding_lookup(ids1, w, buffer).backward(up1)
    assert torch.equal(w.grad, _reference_grad(table, ids1, up1))
    held = w.grad
    w.grad = None  # released by the parameter but still held here: not reused
    embedding_lookup(ids2, w, buffer).backward(up2)
    assert w.grad.data_ptr() != held.data_ptr()
    assert torch.equal(held, _reference_grad(table, ids1, up1))
    second = w.grad.data_ptr()
    w.grad = None
    embedding_lookup(ids2, w, buffer).backward(up2)  # now free again: the same storage
    assert w.grad.data_ptr() == second
    assert torch.equal(w.grad, _reference_grad(table, ids2, up2))


def test_vocab_parallel_embedding_gradient_tp1():
    ps = single_process_state()
    emb = VocabParallelEmbedding(8, 5, vocab_size=7, ps=ps, init_std=1.0)
    with torch.no_grad():
        emb.weight.normal_(generator=torch.Generator().manual_seed(3))
    table = emb.weight.detach().clone()
    for seed in (1, 2):
        ids, up = _case(seed)
        emb(ids).backward(up)
        assert torch.equal(emb.weight.grad, _reference_grad(table, ids, up))
        emb.weight.grad = None
