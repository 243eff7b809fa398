"""Block attention with its log-sum-exp, the piece context-parallel attention is built from.

A block is the attention of some queries ``q`` ``[b, nh, sq, d]`` to some keys/values
``k`` ``[b, ng, sk, d]``, ``v`` ``[b, ng, sk, dv]`` (``nh`` a multiple of ``ng``,
grouped-query attention; ``dv`` may differ from ``d``, multi-latent attention) under a
boolean ``keep`` mask broadcastable to ``[b, nh, sq, sk]`` (True: attend; None: attend to
all). It returns the block's output and ``lse = log sum_j exp(score_ij)`` per query; two
blocks of the same queries combine exactly with :func:`merge` (log-sum-exp weights), which
is how ring attention adds up the key/value blocks that travel around the cp ring.

* :func:`explicit_block`: explicit fp32 scores, softmax and dropout (any device); the
  reference, and the backward of every block (:func:`explicit_block_backward`,
  flash-attention's recomputation formulas, given the final output and lse).
* :func:`sdpa_block`: PyTorch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``)
  which returns the lse; falls back to the explicit block with dropout, on other devices,
  for a value head dim other than the key's, or for rows that a document mask leaves
  empty.
* :func:`flash_block`: flash-attn's ``flash_attn_func(..., return_attn_probs=True)`` (CUDA,
  fp16/bf16; imported when first used).

Dropout draws its masks from an explicit ``torch.Generator`` (seeded per call by the
context-parallel kernel), so the backward can draw the very same masks again.
A fully masked query row (possible only with document masks) has ``lse = -inf`` and
output 0.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, ng, s, d]`` -> ``[b, heads, s, d]`` (each group repeated for its query heads)."""
    rep = heads // t.shape[1]
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _reduce_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`_expand_groups` for gradients: sum each group's query heads."""
    b, heads, s, d = t.shape
    if heads == groups:
        return t
    return t.view(b, groups, heads // groups, s, d).sum(dim=2)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (empty rows) replaced by 0, safe to subtract."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def dropout_mask(shape, p: float, generator: torch.Generator | None, device) -> torch.Tensor:
    """fp32 ``keep / (1 - p)`` with keep drawn from ``generator`` (probability ``1 - p``)."""
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.float() / (1.0 - p)


def explicit_block(q, k, v, keep, scale: float, dropout_p: float = 0.0,
                   generator: torch.Generator | None = None):
    """(out fp32 ``[b, nh, sq, d]``, lse fp32 ``[b, nh, sq]``); differentiable by autograd."""
    nh = q.shape[1]
    k, v = _expand_groups(k, nh), _expand_groups(v, nh)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    if dropout_p > 0.0:
        probs = probs * dropout_mask(probs.shape, dropout_p, generator, probs.device)
    return torch.matmul(probs, v.float()), lse


def explicit_block_backward(q, k, v, grad_out, lse, delta, keep, scale: float,
                            dropout_p: float = 0.0, generator: torch.Generator | None = None):
    """Gradients (fp32) of one block given the *final* (all blocks merged) ``lse`` and
    ``delta = rowsum(grad_out * out)`` of its queries: ``(dq [b, nh, sq, d],
    dk [b, ng, sk, d], dv [b, ng, sk, d])``. With dropout, ``generator`` must be in the
    state the forward drew this block's mask from."""
    nh, ng = q.shape[1], k.shape[1]
    qf, kf, vf = q.float(), _expand_groups(k, nh).float(), _expand_groups(v, nh).float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, NEG_INF)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))       # final softmax of the block
    grad_probs = torch.matmul(grad_out, vf.transpose(-1, -2))
    dropped = probs
    if dropout_p > 0.0:
        mask = dropout_mask(probs.shape, dropout_p, generator, probs.device)
        dropped, grad_probs = probs * mask, grad_probs * mask
    dv = torch.matmul(dropped.transpose(-1, -2), grad_out)
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    dq = torch.matmul(grad_scores, kf) * scale
    dk = torch.matmul(grad_scores.transpose(-1, -2), qf) * scale
    return dq, _reduce_groups(dk, ng), _reduce_groups(dv, ng)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial results of the same queries: fp32 outputs ``[b, nh, sq, d]`` and
    lse ``[b, nh, sq]`` -> (out, lse) of attention over both key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    out = (out_a * torch.exp(lse_a - safe).unsqueeze(-1)
           + out_b * torch.exp(lse_b - safe).unsqueeze(-1))
    return out, lse


def sdpa_block(q, k, v, keep, scale: float, dropout_p: float = 0.0,
               generator: torch.Generator | None = None):
    """:func:`explicit_block`'s result from PyTorch's CPU flash kernel (forward only)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if (op is None or dropout_p > 0.0 or q.device.type != "cpu" or v.shape[-1] != q.shape[-1]
            or (keep is not None and not bool(keep.any(dim=-1).all()))):
        return explicit_block(q, k, v, keep, scale, dropout_p, generator)
    nh = q.shape[1]
    k, v = _expand_groups(k, nh), _expand_groups(v, nh)
    bias = None
    if keep is not None:
        shape = (q.shape[0], nh, q.shape[2], k.shape[2])
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~keep, NEG_INF).expand(shape)
    out, lse = op(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out.float(), lse.float()


def _is_causal(keep: torch.Tensor) -> bool:
    """``keep`` is one square lower-triangular mask (the diagonal block of a chunk)."""
    sq, sk = keep.shape[-2:]
    if sq != sk or keep.shape[:-2].numel() != 1:
        return False
    return bool(torch.equal(keep.reshape(sq, sk),
                            torch.ones(sq, sk, dtype=torch.bool, device=keep.device).tril()))


def flash_block(q, k, v, keep, scale: float, dropout_p: float = 0.0,
                generator: torch.Generator | None = None):
    """flash-attn's kernel for full blocks and causal diagonal blocks (CUDA, half
    precision; not exercised on the CPU machines megalite is tested on); other masks and
    dropout take the explicit block."""
    causal = keep is not None and _is_causal(keep)
    if dropout_p > 0.0 or (keep is not None and not causal):
        return explicit_block(q, k, v, keep, scale, dropout_p, generator)
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2).float(), lse.float()
