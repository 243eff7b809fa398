"""Reused CPU buffers: the embedding lookup's gradient and the output layer's logits and
weight gradient are the same as ``F.embedding`` / ``F.linear``'s, bit for bit, and their
storage is handed out again only when nothing else holds it."""

import torch
import torch.nn.functional as F

import pytest

from megalite.layers.embedding import ReusedGradBuffer, VocabParallelEmbedding, embedding_lookup
from megalite.layers.reused_buffer import reused_linear
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


def _linear_case(seed, s=6, b=2, h=5, v=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, b, h, generator=g), torch.randn(s, b, v, generator=g)


def _reference_linear(x, w, up):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = F.linear(x, w)
    y.backward(up)
    return y.detach(), x.grad, w.grad


def test_reused_linear_values_and_gradients_bitwise_and_accumulating():
    w0 = torch.randn(11, 5, generator=torch.Generator().manual_seed(0))
    bufs = (ReusedGradBuffer(), ReusedGradBuffer())
    w = w0.clone().requires_grad_(True)
    # two micro-batches accumulate into w.grad: the second backward must not overwrite it
    want_w = None
    for seed in (1, 2):
        x0, up = _linear_case(seed)
        x = x0.clone().requires_grad_(True)
        y = reused_linear(x, w, *bufs)
        ref_y, ref_dx, ref_dw = _reference_linear(x0, w0, up)
        assert torch.equal(y, ref_y)
        y.backward(up)
        assert torch.equal(x.grad, ref_dx)
        want_w = ref_dw if want_w is None else want_w + ref_dw
        assert torch.equal(w.grad, want_w)
    x0, up = _linear_case(3)
    ptrs = []
    for _ in range(2):
        w.grad = None
        reused_linear(x0, w, *bufs).backward(up)
        assert torch.equal(w.grad, _reference_linear(x0, w0, up)[2])
        ptrs.append(w.grad.data_ptr())
    assert ptrs[0] == ptrs[1]                  # released, so the same storage again


def test_reused_linear_output_kept_while_held():
    w = torch.randn(11, 5, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    bufs = (ReusedGradBuffer(), ReusedGradBuffer())
    x1, _ = _linear_case(1)
    x2, _ = _linear_case(2)
    y1 = reused_linear(x1, w, *bufs)
    kept = y1.detach().clone()
    y2 = reused_linear(x2, w, *bufs)        # y1 still alive: new storage for y2
    assert y2.data_ptr() != y1.data_ptr() and torch.equal(y1, kept)
    ptr2 = y2.data_ptr()
    del y1, y2
    y3 = reused_linear(x1, w, *bufs)         # both released: y2's storage is kept
    assert y3.data_ptr() == ptr2 and torch.equal(y3, kept)


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_output_layer_reuse_bitwise(tied):
    """A tiny GPT trained 3 steps of 2 micro-batches with the output layer's buffers
    reused gives the same losses and gradients, bit for bit, as with plain F.linear."""
    from megalite.config import ModelConfig
    from megalite.models.gpt import GPTModel
    ps = single_process_state()
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, vocab_size=96,
                      untie_embeddings_and_output_weights=not tied)
    models = [GPTModel(cfg, ps, seed=5) for _ in range(2)]
    assert models[0].output_layer._reused is not None
    models[1].output_layer._reused = None
    models[1].embedding.word_embeddings._grad_buffer = None
    g = torch.Generator().manual_seed(9)
    for _step in range(3):
        for p0, p1 in zip(*(m.parameters() for m in models)):
            p0.grad = p1.grad = None
        for _micro in range(2):
            ids = torch.randint(0, 96, (2, 17), generator=g)
            losses = [m(ids[:, :-1], labels=ids[:, 1:]).mean() for m in models]
            for loss in losses:
                loss.backward()
            assert torch.equal(losses[0], losses[1])
        for (name, p0), p1 in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p0.grad, p1.grad), name
