"""The interface every attention kernel implements."""

from __future__ import annotations

import torch

from megalite.parallel.random import TENSOR_PARALLEL


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with dropout on the probabilities.

    q and k ``[s, b, nh|ng, d]``, v ``[s, b, ng, dv]`` (``nh`` a multiple of ``ng``: each
    group of ``nh/ng`` consecutive query heads shares one key/value head) ->
    ``[s, b, nh * dv]``; ``dv`` may differ from ``d`` (multi-latent attention) unless
    ``needs_same_head_dims``.
    Dropout draws from the tracker's tensor-parallel stream (heads differ per TP rank).

    Subclasses implement :meth:`attend`, when they cannot run everywhere
    :meth:`unavailable`, and for ring context parallelism ``lse_block``.
    """

    name = "base"
    # (q, k, v, keep, scale, dropout_p, generator) -> (out, lse): one block with its
    # log-sum-exp, for ring attention (``context_parallel.blocks``); None: cannot
    lse_block = None
    # True: v must have q's and k's head dim (multi-latent attention's differs)
    needs_same_head_dims = False

    def __init__(self, dropout: float, rng):
        super().__init__()
        self.dropout = dropout
        self.rng = rng

    @property
    def backend(self) -> str:
        return self.name

    @classmethod
    def unavailable(cls, device, dtype: torch.dtype) -> str | None:
        """Why this kernel cannot run on ``device`` in ``dtype``, or None if it can."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``document_ids`` ``[b, s]``: attend only within documents (causal and same id),
        through :meth:`attend_documents`."""
        p = self.dropout if self.training else 0.0
        attend = self.attend if document_ids is None else (
            lambda *a: self.attend_documents(*a, document_ids))
        if p > 0.0:
            with self.rng.fork(TENSOR_PARALLEL):
                return attend(q, k, v, p)
        return attend(q, k, v, p)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout_p: float) -> torch.Tensor:
        """The kernel itself: shapes as in the class docstring."""
        raise NotImplementedError

    def attend_documents(self, q, k, v, dropout_p: float,
                         document_ids: torch.Tensor) -> torch.Tensor:
        """Causal attention within documents (``document_ids`` ``[b, s]``): SDPA with a
        boolean mask for ``sdpa``, else the explicit fp32 block (dropout from the
        default generator, i.e. the forked stream)."""
        from contextlib import nullcontext

        from megalite.transformer.attention_kernels.context_parallel.base import (
            keep_mask,
            masked_attention,
        )

        pos = torch.arange(q.shape[0], device=q.device)
        keep = keep_mask(pos, pos, document_ids)
        out = masked_attention(self, *to_batch_heads(q, k, v), keep, dropout_p, None,
                               nullcontext())
        return from_batch_heads(out)


def to_batch_heads(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[s, b, heads, d]`` -> ``[b, heads, s, d]`` views."""
    return tuple(t.permute(1, 2, 0, 3) for t in tensors)


def from_batch_heads(out: torch.Tensor) -> torch.Tensor:
    """``[b, nh, s, d]`` -> ``[s, b, nh * d]``."""
    b, nh, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)
