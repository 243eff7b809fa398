"""The attention-kernel seam: every registered kernel computes the same attention, the
config picks one in one place, and a new kernel is one class plus one registry entry."""

import pytest
import torch

from megalite.config import ConfigError
from megalite.transformer import attention_kernels
from megalite.transformer.attention_kernels import (
    KERNELS,
    CoreAttention,
    build_core_attention,
    select_attention_backend,
)
from megalite.transformer.attention_kernels.local import local_attention
from tests.model.common import llama_config, single_process_state

CPU = torch.device("cpu")


def _qkv(s=6, b=2, nh=4, ng=2, d=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d, generator=g).requires_grad_(True)
               for n in (nh, ng, ng))
    return q, k, v


def _reference(q, k, v):
    """Attention written out per head, with the GQA repeat and the causal mask by hand."""
    s, b, nh, d = q.shape
    rep = nh // k.shape[2]
    out = torch.empty(s, b, nh, d, dtype=q.dtype)
    for h in range(nh):
        qh, kh, vh = q[:, :, h], k[:, :, h // rep], v[:, :, h // rep]  # [s, b, d]
        scores = torch.einsum("sbd,tbd->bst", qh, kh) / d ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = torch.einsum("bst,tbd->sbd", scores.softmax(-1), vh)
    return out.reshape(s, b, nh * d)


@pytest.mark.parametrize("name", [n for n, k in KERNELS.items()
                                  if k.unavailable(CPU, torch.float32) is None])
def test_every_kernel_that_runs_here_matches_the_reference(name):
    q, k, v = _qkv()
    out = KERNELS[name](0.0, rng=None).eval()(q, k, v)
    want = _reference(*(t.detach().clone().requires_grad_(True) for t in (q, k, v)))
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want_grads = torch.autograd.grad(_reference(q2, k2, v2).square().sum(), (q2, k2, v2))
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_local_kernel_is_plain_softmax_attention():
    q, k, v = (t.permute(1, 2, 0, 3) for t in _qkv(nh=2, ng=2))
    out = local_attention(q, k, v, 0.0)
    assert out.shape == q.shape


def test_config_picks_the_kernel_in_one_place():
    ps = single_process_state()
    for name in ("local", "sdpa"):
        kernel = build_core_attention(llama_config(attention_backend=name), ps, rng=None)
        assert type(kernel) is KERNELS[name] and kernel.backend == name
    assert select_attention_backend("auto", CPU, torch.float32) == "sdpa"  # no flash here
    with pytest.raises(ConfigError, match="unknown attention backend 'ring'; choose auto or "
                                          "one of local, sdpa, flash"):
        select_attention_backend("ring", CPU, torch.float32)
    with pytest.raises(ConfigError, match="flash needs flash-attn installed, a CUDA device"):
        select_attention_backend("flash", CPU, torch.bfloat16)


def test_a_new_kernel_is_one_class_and_one_registry_line(monkeypatch):
    class Doubled(CoreAttention):
        name = "doubled"

        def attend(self, q, k, v, dropout_p):
            return 2 * KERNELS["local"].attend(self, q, k, v, dropout_p)

    monkeypatch.setitem(attention_kernels.KERNELS, "doubled", Doubled)
    ps = single_process_state()
    cfg = llama_config()
    cfg.attention_backend = "doubled"  # the CLI's --attention-backend choices list it too
    kernel = build_core_attention(cfg, ps, rng=None)
    q, k, v = _qkv()
    torch.testing.assert_close(kernel(q, k, v), 2 * KERNELS["local"](0.0, None)(q, k, v))
