"""All-to-all context parallelism (``--cp-comm-type a2a``, DeepSpeed's Ulysses).

An all-to-all over ``ps.cp`` turns the sequence-sharded q, k, v ``[s/cp, b, heads, d]``
into head-sharded ``[s, b, heads/cp, d]`` (rank j gets head group j of every rank's
tokens); the tokens are put in global order, the wrapped kernel runs ordinary causal
attention on the whole sequence for its heads, and a second all-to-all brings the output
back to ``[s/cp, b, nh * d]``. Needs the local query heads and key/value groups
divisible by cp (``ModelConfig.check_layout``). Per-rank communication:
``(cp - 1) / cp`` of q, k, v and the output, forward and backward.
"""

from __future__ import annotations

import torch

from megalite.parallel.cp_chunks import rank_order
from megalite.parallel.mappings import all_to_all
from megalite.transformer.attention_kernels.base import from_batch_heads, to_batch_heads
from megalite.transformer.attention_kernels.context_parallel.base import (
    ContextParallelAttention,
    keep_mask,
    masked_attention,
)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/cp, b, H, d]`` (this rank's chunks) -> ``[s, b, H/cp, d]`` (head group
    ``group.rank`` of the whole sequence, in rank order of the chunks), over ``group``."""
    s_local, b, heads, d = x.shape
    cp = group.size
    blocks = x.view(s_local, b, cp, heads // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    return all_to_all(blocks.view(cp * s_local, b, heads // cp, d), group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[s, b, H/cp, d]`` in rank order ->
    ``[s/cp, b, H, d]``."""
    seq, b, heads_local, d = x.shape
    cp = group.size
    out = all_to_all(x.contiguous(), group).view(cp, seq // cp, b, heads_local, d)
    return out.permute(1, 2, 0, 3, 4).reshape(seq // cp, b, cp * heads_local, d)


class UlyssesAttention(ContextParallelAttention):
    comm_type = "a2a"

    def attend_cp(self, q, k, v, dropout_p, seed, document_ids):
        s_local, b, nh, d = q.shape
        cp = self.cp.size
        seq = s_local * cp
        ng, dv = k.shape[2], v.shape[-1]
        # [s/cp, b, cp * w, 1]: per head group j its nh/cp query heads, ng/cp keys and
        # ng/cp values flattened (w channels; v's head dim may differ), so that one
        # all-to-all moves all three
        parts = [t.reshape(s_local, b, cp, -1) for t in (q, k, v)]
        widths = [p.shape[-1] for p in parts]
        qkv = torch.cat(parts, dim=3).reshape(s_local, b, -1, 1)
        sent = qkv.numel() * qkv.element_size() * (cp - 1) // cp
        out_bytes = q.numel() // d * dv * q.element_size()
        self.sent_bytes += 2 * sent + 2 * (out_bytes * (cp - 1) // cp)
        heads = seq_to_heads(qkv, self.cp)                          # [s, b, w, 1]
        order = rank_order(seq, cp, q.device)
        heads = heads.index_select(0, torch.argsort(order)).view(seq, b, -1)  # global order
        qh, kh, vh = heads.split(widths, dim=-1)
        qh, kh = qh.view(seq, b, nh // cp, d), kh.view(seq, b, ng // cp, d)
        vh = vh.view(seq, b, ng // cp, dv)
        if document_ids is None:
            with self.seeded(seed):
                out = self.base.attend(qh, kh, vh, dropout_p)       # [s, b, nh/cp * d]
        else:
            pos = torch.arange(seq, device=q.device)
            keep = keep_mask(pos, pos, document_ids)
            out = from_batch_heads(masked_attention(
                self.base, *to_batch_heads(qh, kh, vh), keep, dropout_p,
                self.generator(seed), self.seeded(seed)))
        out = out.view(seq, b, nh // cp, dv).index_select(0, order)  # rank order
        return heads_to_seq(out, self.cp).reshape(s_local, b, nh * dv)
