"""All-gather context parallelism (``--cp-comm-type allgather``, torchtitan's only kind).

Queries stay sharded; keys and values are all-gathered over ``ps.cp`` (backward:
reduce-scatter of their gradients, :func:`gather_from_sequence_parallel_region`) and put
back in global order. Each local query chunk ``i`` (global positions ``[i c, (i+1) c)``)
then attends to the key prefix ``[0, (i+1) c)`` with a causal mask aligned to its end, so
rank r computes ``(r + 1) + (2cp - r)`` chunk-blocks: the same on every rank.
Per-rank communication: ``2 (cp - 1) / cp`` of the full key/value tensors forward, the
same backward.
"""

from __future__ import annotations

import torch

from megalite.parallel.cp_chunks import rank_order
from megalite.parallel.mappings import gather_from_sequence_parallel_region
from megalite.transformer.attention_kernels.base import from_batch_heads, to_batch_heads
from megalite.transformer.attention_kernels.context_parallel.base import (
    ContextParallelAttention,
    keep_mask,
    masked_attention,
)


class AllGatherAttention(ContextParallelAttention):
    comm_type = "allgather"

    def attend_cp(self, q, k, v, dropout_p, seed, document_ids):
        s_local = q.shape[0]
        cp, c = self.cp.size, s_local // 2
        seq = s_local * cp
        kv = torch.cat([k, v], dim=-1)                         # [s/cp, b, ng, d + dv]
        self.sent_bytes += 2 * (cp - 1) * kv.numel() * kv.element_size()  # fwd + bwd
        kv = gather_from_sequence_parallel_region(kv, self.cp)  # [s, b, ng, d + dv]
        kv = kv.index_select(0, torch.argsort(rank_order(seq, cp, kv.device)))
        k_all, v_all = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        generator = self.generator(seed)
        outs = []
        for local, chunk in enumerate(self.my_chunks()):
            end = (chunk + 1) * c
            q_pos = torch.arange(chunk * c, end, device=q.device)
            keep = keep_mask(q_pos, torch.arange(end, device=q.device), document_ids)
            qb, kb, vb = to_batch_heads(q[local * c:(local + 1) * c], k_all[:end],
                                        v_all[:end])
            outs.append(masked_attention(self.base, qb, kb, vb, keep, dropout_p, generator,
                                         self.seeded(seed)))
        return from_batch_heads(torch.cat(outs, dim=2))
