"""--cross-entropy-loss-fusion: the chunked vocab-parallel cross entropy gives the default
path's loss and gradients (fp32, 1e-6) at tp 1 and 2, with padded vocabulary and ignored
targets, whatever the chunk size; and it saves less for backward."""

import pytest
import torch

from megalite.config import ConfigError, ModelConfig
from megalite.layers.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from megalite.layers.cross_entropy import vocab_parallel_cross_entropy
from megalite.models.gpt import GPTModel
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import batch, llama_config, single_process_state

VOCAB, PADDED, S, B = 50, 64, 7, 3
TOL = 1e-6


def _case(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    full = (3 * torch.randn(S, B, PADDED, generator=g)).to(dtype)
    full[..., VOCAB:] = 50.0  # would dominate the softmax if padding were not masked
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    target[0, 0] = target[4, 2] = -100
    target[2, 1] = VOCAB - 1  # the last real token: on the last rank at tp 2
    up = torch.randn(S, B, generator=g)
    return full, target, up


def _loss_and_grad(fn, full, target, up, group, **kw):
    local = full.chunk(group.size, dim=-1)[group.rank].clone().requires_grad_(True)
    loss = fn(local, target, group, vocab_size=VOCAB, **kw)
    loss.backward(up)
    return loss.detach(), local.grad


def _compare(group):
    full, target, up = _case()
    want_loss, want_grad = _loss_and_grad(vocab_parallel_cross_entropy, full, target, up, group)
    errors = []
    for rows in (1, 4, S * B, None):
        loss, grad = _loss_and_grad(chunked_vocab_parallel_cross_entropy, full, target, up,
                                    group, chunk_rows=rows)
        assert grad.dtype == torch.float32
        assert torch.all(loss[target == -100] == 0)
        assert torch.all(grad.view(S, B, -1)[target == -100] == 0)
        errors.append(max((loss - want_loss).abs().max().item(),
                          (grad - want_grad).abs().max().item()))
    return max(errors)


def _tp2_body(rank, world_size):
    with parallel_state(tensor_model_parallel_size=world_size) as ps:
        return _compare(ps.tp)


def test_matches_default_tp1():
    assert _compare(single_process_state().tp) < TOL


def test_matches_default_tp2():
    assert max(run_distributed(2, _tp2_body)) < TOL


def test_bf16_logits_match_default():
    full, target, up = _case(torch.bfloat16)
    tp = single_process_state().tp
    want_loss, want_grad = _loss_and_grad(vocab_parallel_cross_entropy, full, target, up, tp)
    loss, grad = _loss_and_grad(chunked_vocab_parallel_cross_entropy, full, target, up, tp,
                                chunk_rows=5)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert (loss - want_loss).abs().max().item() < TOL
    assert torch.equal(grad, want_grad)  # same fp32 values, one rounding to bf16


def _saved_bytes(fn, logits, target):
    total = []

    def pack(t):
        total.append(t.untyped_storage().nbytes() if t.data_ptr() != logits.data_ptr()
                     else 0)  # the logits themselves are alive anyway in forward
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, target, single_process_state().tp, vocab_size=VOCAB)
    return sum(total)


def test_saves_no_fp32_copy_of_the_logits():
    full, target, _ = _case(torch.bfloat16)
    logits = full.requires_grad_(True)
    default = _saved_bytes(vocab_parallel_cross_entropy, logits, target)
    chunked = _saved_bytes(chunked_vocab_parallel_cross_entropy, logits, target)
    assert default >= S * B * PADDED * 4  # the fp32 softmax
    assert chunked < S * B * 64  # per-token statistics only


def test_model_flag_gives_same_loss_and_grads():
    cfgs = [llama_config(), llama_config(cross_entropy_loss_fusion=True)]
    ids, labels = batch(cfgs[0])
    results = []
    for cfg in cfgs:
        model = GPTModel(cfg, single_process_state(), seed=1)
        loss = model(ids, labels=labels)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert (l0 - l1).abs().max().item() < TOL
    assert max((g0[n] - g1[n]).abs().max().item() for n in g0) < TOL


def test_te_impl_is_refused():
    assert ModelConfig(cross_entropy_fusion_impl="native").cross_entropy_fusion_impl == "native"
    with pytest.raises(ConfigError, match="Transformer Engine"):
        ModelConfig(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
