"""The largest attention logit of each head, for QK-clip (``--qk-clip``) and
``--log-max-attention-logit``.

The statistic is Megatron-Core's (Transformer Engine's ``return_max_logit``, Kimi-K2's
``S_max``): per query head ``h``, the maximum over the batch, the query positions and the
key positions a query may see (causal, and within its document under
``--reset-attention-mask``) of the logit that enters the softmax, ``q . k * scale`` with
the kernel's ``scale = 1 / sqrt(d)`` (multi-latent attention's YaRN factor is already in
its queries, so this is its softmax scale too). It is computed in an extra pass over the
same ``q`` and ``k`` the kernel gets, without gradients, in fp32 and in query chunks so
that the ``[b, heads, chunk, s]`` scores stay small; the attention output itself is not
touched, whatever ``--attention-backend`` computes it (flash and sdpa do not return it).

Under context parallelism each rank holds two chunks of the queries and of the keys
(:mod:`megalite.parallel.cp_chunks`); its queries may see keys of every rank, so the
keys are all-gathered over ``ps.cp`` for this pass (no autograd: a statistic) and masked
by their global positions. The maximum over data-parallel ranks, context-parallel ranks
and micro-batches is then taken once per step (:mod:`megalite.optim.qk_clip`); tensor
parallelism splits heads, so each rank's values are already whole for its heads.
"""

from __future__ import annotations

import math

import torch

from megalite.parallel import collectives
from megalite.parallel.cp_chunks import chunk_positions, rank_order

# query rows per chunk are chosen so that one chunk's scores hold at most this many floats
CHUNK_ELEMENTS = 1 << 22


def head_max_logits(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, document_ids: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """``[nh]`` fp32: per query head, the largest ``q . k * scale`` over the batch and the
    (query, key) pairs with key position <= query position (and the same document).

    ``q`` ``[sq, b, nh, d]``, ``k`` ``[sk, b, ng, d]`` (``nh / ng`` consecutive query heads
    share a key head), ``q_pos`` ``[sq]`` / ``k_pos`` ``[sk]`` their global positions,
    ``document_ids`` ``[b, S]`` over the whole sequence; ``scale`` defaults to
    ``1 / sqrt(d)``. A head whose queries see no key gets ``-inf``."""
    sq, b, nh, d = q.shape
    sk, ng = k.shape[0], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qh = q.detach().float().permute(1, 2, 0, 3).reshape(b, ng, nh // ng, sq, d)
    kh = k.detach().float().permute(1, 2, 0, 3)                      # [b, ng, sk, d]
    rows = max(1, CHUNK_ELEMENTS // max(1, b * nh * sk))
    best = torch.full((nh,), float("-inf"), dtype=torch.float32, device=q.device)
    for lo in range(0, sq, rows):
        hi = min(sq, lo + rows)
        scores = torch.einsum("bgrqd,bgkd->bgrqk", qh[:, :, :, lo:hi], kh) * scale
        keep = k_pos.unsqueeze(0) <= q_pos[lo:hi].unsqueeze(1)         # [q, k]
        keep = keep.unsqueeze(0)                                       # [1|b, q, k]
        if document_ids is not None:
            same = (document_ids[:, q_pos[lo:hi]].unsqueeze(2)
                    == document_ids[:, k_pos].unsqueeze(1))
            keep = keep & same
        scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
        chunk_max = scores.amax(dim=(3, 4)).amax(dim=0).reshape(nh)
        best = torch.maximum(best, chunk_max)
    return best


class MaxLogitTracker:
    """The running maximum ``[nh / tp]`` (fp32) of :func:`head_max_logits` over the
    training forwards of one step on this rank; ``value`` is None before the first.

    ``cp`` is ``ps.cp``: with more than one member, :meth:`observe` all-gathers the keys
    over it (module docstring)."""

    def __init__(self, cp):
        self.cp = cp
        self.value: torch.Tensor | None = None

    def reset(self) -> None:
        self.value = None

    # a python-side running value and a collective: stays eager under --compile (the
    # layer around it compiles; dynamo breaks its graph here)
    @torch.compiler.disable
    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> None:
        """Fold in one forward's ``q`` ``[s/cp, b, nh, d]`` and ``k`` ``[s/cp, b, ng, d]``
        (this rank's load-balanced chunks under cp; collective over ``ps.cp`` then)."""
        s_local = q.shape[0]
        if self.cp.size == 1:
            pos = torch.arange(s_local, device=q.device)
            m = head_max_logits(q, k, pos, pos, document_ids)
        else:
            seq = s_local * self.cp.size
            keys = collectives.all_gather_dim0(k.detach(), self.cp)   # rank order
            q_pos = chunk_positions(seq, self.cp.size, self.cp.rank, q.device)
            m = head_max_logits(q, keys, q_pos, rank_order(seq, self.cp.size, q.device),
                                document_ids)
        self.value = m if self.value is None else torch.maximum(self.value, m)
