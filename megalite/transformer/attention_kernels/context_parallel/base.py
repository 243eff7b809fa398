"""What the three context-parallel attentions share: the wrapped kernel, the cp group, the
chunk layout, dropout seeds and the count of bytes sent."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from megalite.parallel.cp_chunks import chunk_ids
from megalite.parallel.random import TENSOR_PARALLEL
from megalite.transformer.attention_kernels.base import CoreAttention


class ContextParallelAttention(CoreAttention):
    """Causal attention over a sequence split across ``ps.cp`` in the load-balanced layout
    of :mod:`megalite.parallel.cp_chunks`: q ``[s/cp, b, nh, d]``, k and v
    ``[s/cp, b, ng, d]`` (this rank's two chunks) -> ``[s/cp, b, nh * d]``, the rows of
    the full sequence's attention output for this rank's tokens.

    ``base`` is the kernel of ``--attention-backend`` that computes the blocks. Dropout:
    each call draws one seed from the tensor-parallel stream (replayed by recomputation)
    and offsets it by the cp rank, so each cp rank drops its own probabilities.
    ``sent_bytes`` counts what this rank sends to other cp ranks (forward and backward).
    """

    comm_type = "base"

    def __init__(self, base: CoreAttention, ps):
        super().__init__(base.dropout, base.rng)
        self.base = base
        self.cp = ps.cp
        self.device = ps.device
        self.sent_bytes = 0

    @property
    def backend(self) -> str:
        return f"{self.base.name}+cp-{self.comm_type}"

    # collectives and the ring's autograd Function stay eager under --compile (the layer
    # around them compiles; dynamo breaks its graph here)
    @torch.compiler.disable
    def forward(self, q, k, v, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        seed = None
        if p > 0.0:
            with self.rng.fork(TENSOR_PARALLEL):
                seed = int(torch.randint(0, 2 ** 62, (1,), device=self.device).item())
            seed += 1_000_003 * self.cp.rank
        return self.attend_cp(q, k, v, p, seed, document_ids)

    def attend_cp(self, q, k, v, dropout_p: float, seed: int | None,
                  document_ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------
    def generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @contextmanager
    def seeded(self, seed: int | None):
        """Run a kernel that draws from the default generator with ``seed``, restoring the
        default generator afterwards."""
        if seed is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.manual_seed(seed)
            yield

    def my_chunks(self) -> tuple[int, int]:
        return chunk_ids(self.cp.size, self.cp.rank)

    @staticmethod
    def scale(head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)


def keep_mask(q_pos: torch.Tensor, k_pos: torch.Tensor,
              document_ids: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``[b|1, 1, sq, sk]``: key position <= query position (causal) and, with
    ``document_ids`` ``[b, s]`` (global), the same document."""
    keep = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).unsqueeze(0)
    if document_ids is not None:
        same = document_ids[:, q_pos].unsqueeze(2) == document_ids[:, k_pos].unsqueeze(1)
        keep = keep & same
    return keep.unsqueeze(1)


def masked_attention(base: CoreAttention, q, k, v, keep, dropout_p: float,
                     generator, seeded) -> torch.Tensor:
    """Attention of ``[b, nh, sq, d]`` queries to ``[b, ng, sk, d]`` keys/values under a
    ``keep`` mask, by autograd: SDPA with a boolean mask for the ``sdpa`` kernel, else (and
    where a document mask leaves a query row empty) the explicit fp32 block.
    Returns ``[b, nh, sq, d]`` in q's dtype."""
    from megalite.transformer.attention_kernels.context_parallel.blocks import explicit_block

    if base.name != "sdpa" or not bool(keep.any(dim=-1).all()):
        out, _ = explicit_block(q, k, v, keep, 1.0 / math.sqrt(q.shape[-1]), dropout_p,
                                generator)
        return out.to(q.dtype)
    import torch.nn.functional as F

    with seeded:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                              enable_gqa=k.shape[1] != q.shape[1])
