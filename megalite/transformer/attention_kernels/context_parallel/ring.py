"""Ring attention (``--cp-comm-type p2p``, Megatron-LM's default).

The key/value blocks travel around the ring of ``ps.cp`` (send to rank + 1, receive from
rank - 1) while each rank computes its queries' attention to the block it holds; the
partial results combine exactly by their log-sum-exp (``blocks.merge``). At step t rank r
holds the keys/values of rank ``src = r - t (mod cp)``: with the load-balanced chunks
(``parallel.cp_chunks``) a (query chunk, key chunk) pair is skipped (key chunk after the
query chunk), causal (the same chunk) or full (key chunk before), so every step costs every
rank the same half of its blocks.

The backward (:class:`_RingAttentionFunction`) runs the ring again, recomputing each
block from q, k, v and the final lse (flash-attention's formulas, fp32), and passes each
key/value block's gradient accumulator around the ring with it, so after ``cp`` steps each
rank holds the full gradient of its own keys/values. Per-rank communication: ``cp - 1``
key/value blocks forward; ``cp - 1`` key/value blocks and ``cp`` key/value gradients
backward.
"""

from __future__ import annotations

import torch

from megalite.parallel import collectives
from megalite.parallel.cp_chunks import chunk_ids
from megalite.transformer.attention_kernels.base import from_batch_heads, to_batch_heads
from megalite.transformer.attention_kernels.context_parallel.base import (
    ContextParallelAttention,
)
from megalite.transformer.attention_kernels.context_parallel.blocks import (
    NEG_INF,
    explicit_block_backward,
    merge,
)

SKIP = "skip"


def pair_mask(q_chunk: int, k_chunk: int, c: int, document_ids, device):
    """The keep mask of query chunk ``q_chunk`` against key chunk ``k_chunk`` (global chunk
    indices of ``c`` tokens): :data:`SKIP` when no query sees a key, None when every query
    sees every key, else boolean ``[b|1, 1, c, c]``."""
    if k_chunk > q_chunk:
        return SKIP
    keep = None
    if k_chunk == q_chunk:
        keep = torch.ones(c, c, dtype=torch.bool, device=device).tril()[None, None]
    if document_ids is not None:
        dq = document_ids[:, q_chunk * c:(q_chunk + 1) * c]
        dk = document_ids[:, k_chunk * c:(k_chunk + 1) * c]
        same = (dq.unsqueeze(2) == dk.unsqueeze(1)).unsqueeze(1)
        keep = same if keep is None else keep & same
    return keep


def _pairs(cp: int, rank: int, step: int, c: int, document_ids, device):
    """(local query chunk, local key chunk, mask) of one ring step, in a fixed order."""
    src = (rank - step) % cp
    mine, theirs = chunk_ids(cp, rank), chunk_ids(cp, src)
    for a, qa in enumerate(mine):
        for b, kb in enumerate(theirs):
            keep = pair_mask(qa, kb, c, document_ids, device)
            if keep is not SKIP:
                yield a, b, keep


class _RingAttentionFunction(torch.autograd.Function):
    """q, k ``[b, nh|ng, 2c, d]``, v ``[b, ng, 2c, dv]`` (this rank's two chunks) ->
    ``[b, nh, 2c, dv]``; see the module docstring. Keys and values travel as one tensor
    ``[b, ng, 2c, d + dv]``."""

    @staticmethod
    def forward(ctx, q, k, v, module, block, dropout_p, seed, document_ids):
        group = module.cp
        cp, rank = group.size, group.rank
        c = q.shape[2] // 2
        scale = module.scale(q.shape[-1])
        generator = module.generator(seed)
        b, nh, _, d = q.shape
        outs = [torch.zeros(b, nh, c, v.shape[-1], dtype=torch.float32, device=q.device)
                for _ in range(2)]
        lses = [torch.full((b, nh, c), NEG_INF, dtype=torch.float32, device=q.device)
                for _ in range(2)]
        kv = torch.cat([k, v], dim=-1).contiguous()                # [b, ng, 2c, d + dv]
        for step in range(cp):
            works = []
            if step < cp - 1:   # prefetch the next block while computing on this one
                nxt, works = collectives.ring_exchange(kv, group)
                module.sent_bytes += kv.numel() * kv.element_size()
            for a, kb, keep in _pairs(cp, rank, step, c, document_ids, q.device):
                ks = slice(kb * c, (kb + 1) * c)
                kb_, vb_ = kv[:, :, ks].split([d, v.shape[-1]], dim=-1)
                out, lse = block(q[:, :, a * c:(a + 1) * c], kb_, vb_, keep, scale, dropout_p,
                                 generator)
                outs[a], lses[a] = merge(outs[a], lses[a], out, lse)
            if works:
                collectives.wait_all(works)
                kv = nxt
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, document_ids)
        ctx.module, ctx.dropout_p, ctx.seed = module, dropout_p, seed
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, document_ids = ctx.saved_tensors
        module = ctx.module
        group = module.cp
        cp, rank = group.size, group.rank
        c = q.shape[2] // 2
        scale = module.scale(q.shape[-1])
        generator = module.generator(ctx.seed)   # the forward's masks, in the same order
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(dim=-1)                        # [b, nh, 2c]
        dq = torch.zeros_like(q, dtype=torch.float32)
        d = k.shape[-1]
        kv = torch.cat([k, v], dim=-1).contiguous()
        dkv = torch.zeros_like(kv, dtype=torch.float32)             # travels with its kv
        for step in range(cp):
            works = []
            if step < cp - 1:
                nxt, works = collectives.ring_exchange(kv, group)
                module.sent_bytes += kv.numel() * kv.element_size()
            for a, kb, keep in _pairs(cp, rank, step, c, document_ids, q.device):
                qs, ks = slice(a * c, (a + 1) * c), slice(kb * c, (kb + 1) * c)
                kb_, vb_ = kv[:, :, ks].split([d, v.shape[-1]], dim=-1)
                dq_a, dk_b, dv_b = explicit_block_backward(
                    q[:, :, qs], kb_, vb_, grad_out[:, :, qs], lse[:, :, qs],
                    delta[:, :, qs], keep, scale, ctx.dropout_p, generator)
                dq[:, :, qs] += dq_a
                dkv[:, :, ks, :d] += dk_b
                dkv[:, :, ks, d:] += dv_b
            if works:
                collectives.wait_all(works)
                kv = nxt
            # the gradient goes to the block's next holder (its owner after the last step)
            module.sent_bytes += dkv.numel() * dkv.element_size() if cp > 1 else 0
            dkv, dworks = collectives.ring_exchange(dkv, group)
            collectives.wait_all(dworks)
        return (dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype),
                None, None, None, None, None)


class RingAttention(ContextParallelAttention):
    comm_type = "p2p"

    def __init__(self, base, ps):
        super().__init__(base, ps)
        self.block = type(base).lse_block
        if self.block is None:
            raise ValueError(f"attention kernel {base.name} cannot return the log-sum-exp")

    def attend_cp(self, q, k, v, dropout_p, seed, document_ids):
        qb, kb, vb = to_batch_heads(q, k, v)
        out = _RingAttentionFunction.apply(qb.contiguous(), kb.contiguous(), vb.contiguous(),
                                           self, self.block, dropout_p, seed, document_ids)
        return from_batch_heads(out)
