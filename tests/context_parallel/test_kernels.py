"""Context-parallel attention kernels against autograd of the full attention.

Each cp rank gets its load-balanced chunks of random q, k, v (GQA: 4 query heads, 2
groups), runs the cp kernel (p2p ring, allgather, a2a) over the local (explicit fp32) or
sdpa block kernel, and back-propagates a random output gradient. The outputs and the
q / k / v gradients, put back in global order, must match the full-sequence attention
computed in fp64 by autograd (fp32 kernels: 2e-5). With document ids the reference is the
same explicit attention under the causal-and-same-document mask. Also: the block
primitives themselves (lse, merge, the recomputing backward, dropout masks replayed).
"""

import math

import pytest
import torch

from megalite.parallel.cp_chunks import chunk_positions, unshuffle
from megalite.parallel.random import RNGTracker
from megalite.transformer.attention_kernels import KERNELS, build_core_attention
from megalite.transformer.attention_kernels.context_parallel import blocks
from tests.distributed.harness import parallel_state, run_distributed

S, B, NH, NG, D = 32, 2, 4, 2, 8
TOL = 2e-5


class _Cfg:
    def __init__(self, backend, comm, dropout=0.0):
        self.attention_backend, self.cp_comm_type = backend, comm
        self.attention_dropout = dropout


def _inputs(seed=0, docs=False, ng=NG, dv=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, NH, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, B, ng, D, generator=g, dtype=torch.float64)
    v = torch.randn(S, B, ng, dv, generator=g, dtype=torch.float64)
    grad = torch.randn(S, B, NH * dv, generator=g, dtype=torch.float64)
    doc = None
    if docs:   # documents of random lengths, different per sample
        ends = torch.rand(B, S, generator=g) < 0.15
        doc = torch.cumsum(ends.long(), dim=1)
    return q, k, v, grad, doc


def full_attention(q, k, v, doc=None):
    """fp64 reference: ``[s, b, heads, d]`` -> ``[s, b, nh * d]``, causal (+ documents)."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    rep = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(rep, 1), vb.repeat_interleave(rep, 1)
    scores = qb @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[0]
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if doc is not None:
        keep = keep & (doc[:, :, None] == doc[:, None, :])[:, None]
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    out = probs @ vb
    return out.permute(2, 0, 1, 3).reshape(s, q.shape[1], -1)


def _cp_body(rank, world_size, cases):
    results = []
    with parallel_state(context_parallel_size=world_size) as ps:
        for backend, comm, docs, ng, dv in cases:
            q, k, v, grad, doc = _inputs(docs=docs, ng=ng, dv=dv)
            idx = chunk_positions(S, world_size, ps.cp.rank)
            local = [t[idx].float().requires_grad_() for t in (q, k, v)]
            kernel = build_core_attention(_Cfg(backend, comm), ps, RNGTracker.from_state(ps, 1))
            out = kernel(*local, document_ids=doc)
            out.backward(grad[idx].float())
            results.append((out.detach(), *(t.grad for t in local), kernel.sent_bytes))
    return results


def _cases(cp):
    """(backend, comm type, document ids, query groups, value head dim): a2a needs the
    groups divisible by cp (MHA at cp 4). At cp 2 also multi-latent attention's shape:
    one key/value head per query head, values 6 wide against keys of 8."""
    cases = [(backend, comm, docs) for comm in ("p2p", "allgather", "a2a")
             for backend, docs in (("local", False), ("sdpa", False), ("local", True))]
    out = [(*c, NG if c[1] != "a2a" or NG % cp == 0 else NH, D) for c in cases]
    if cp == 2:
        out += [(backend, comm, False, NH, 6) for comm in ("p2p", "allgather", "a2a")
                for backend in ("local", "sdpa")]
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_kernels_match_full_attention(cp):
    cases = _cases(cp)
    per_rank = run_distributed(cp, _cp_body, cases)
    for n, (backend, comm, docs, ng, dv) in enumerate(cases):
        q, k, v, grad, doc = _inputs(docs=docs, ng=ng, dv=dv)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = full_attention(*leaves, doc)
        want.backward(grad)
        got = [unshuffle([r[n][i] for r in per_rank]) for i in range(4)]
        what = f"{comm}/{backend}/docs={docs}/dv={dv}/cp{cp}"
        torch.testing.assert_close(got[0].double(), want, rtol=0, atol=TOL, msg=what)
        for name, g, leaf in zip("qkv", got[1:], leaves):
            torch.testing.assert_close(g.double(), leaf.grad, rtol=0, atol=TOL,
                                       msg=f"{what} d{name}")
        assert all(r[n][4] > 0 for r in per_rank), what   # it did communicate


def test_block_lse_merge_and_backward():
    """Two key blocks merged by lse equal one block over both; the recomputing backward
    equals autograd's, with dropout masks drawn again from the same seed."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 10, 8, generator=g, requires_grad=True)
    keep = torch.rand(1, 1, 6, 10, generator=g) < 0.7
    keep[..., 0] = True
    scale = 8 ** -0.5
    out, lse = blocks.explicit_block(q, k, v, keep, scale)
    o1, l1 = blocks.explicit_block(q, k[:, :, :4], v[:, :, :4], keep[..., :4], scale)
    o2, l2 = blocks.sdpa_block(q, k[:, :, 4:], v[:, :, 4:], keep[..., 4:], scale)
    merged, mlse = blocks.merge(o1, l1, o2, l2)
    torch.testing.assert_close(merged, out, rtol=0, atol=1e-5)
    torch.testing.assert_close(mlse, lse, rtol=0, atol=1e-5)
    for p in (0.0, 0.3):
        grad = torch.randn(out.shape, generator=g)
        out, lse = blocks.explicit_block(q, k, v, keep, scale, p,
                                         torch.Generator().manual_seed(7))
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        delta = (grad * out.detach()).sum(-1)
        mine = blocks.explicit_block_backward(q.detach(), k.detach(), v.detach(), grad,
                                              lse.detach(), delta, keep, scale, p,
                                              torch.Generator().manual_seed(7))
        for a, b in zip(mine, (dq, dk, dv)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _no_lse_body(rank, world_size):
    class NoLse(KERNELS["local"]):
        name = "nolse"
        lse_block = None

    from megalite.config import ConfigError

    KERNELS["nolse"] = NoLse
    try:
        with parallel_state(context_parallel_size=2) as ps:
            with pytest.raises(ConfigError, match="cannot return the log-sum-exp"):
                build_core_attention(_Cfg("nolse", "p2p"), ps, RNGTracker.from_state(ps, 1))
            # allgather and a2a need no lse
            build_core_attention(_Cfg("nolse", "allgather"), ps, RNGTracker.from_state(ps, 1))
    finally:
        del KERNELS["nolse"]
    return True


def test_ring_needs_a_kernel_with_lse():
    assert run_distributed(2, _no_lse_body) == [True, True]


def _dropout_body(rank, world_size, comm):
    with parallel_state(context_parallel_size=2) as ps:
        q, k, v, grad, _ = _inputs()
        idx = chunk_positions(S, 2, ps.cp.rank)
        local = [t[idx].float().requires_grad_() for t in (q, k, v)]
        kernel = build_core_attention(_Cfg("local", comm, dropout=0.5), ps,
                                      RNGTracker.from_state(ps, 1))
        out = kernel(*local)
        out.backward(grad[idx].float())
        # the same call again (rewound streams) gives the same output: masks are seeded
        kernel.rng = RNGTracker.from_state(ps, 1)
        again = kernel(*[t.detach() for t in local])
        ref = full_attention(*[t.detach() for t in (q, k, v)])[idx].float()
    return out.detach(), again, ref, [t.grad for t in local]


@pytest.mark.parametrize("comm", ["p2p", "allgather", "a2a"])
def test_attention_dropout_is_seeded_and_per_cp_rank(comm):
    per_rank = run_distributed(2, _dropout_body, comm)
    for out, again, ref, grads in per_rank:
        torch.testing.assert_close(out, again)
        assert (out - ref).abs().max() > 1e-2         # dropout did something
        assert all(torch.isfinite(g).all() for g in grads)
