"""Load-balanced sequence chunks of context parallelism: which tokens each cp rank holds.

With causal attention the last tokens of a sequence attend to the most keys. So that every
rank of the cp group does the same attention work, the sequence of length ``s`` is cut into
``2 cp`` chunks of ``c = s / (2 cp)`` tokens and cp rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r`` (Megatron-LM's layout), in that order: its local sequence of ``s / cp``
tokens is ``[chunk r | chunk 2cp-1-r]``. With cp = 2 and s = 8::

    global positions  0 1 | 2 3 | 4 5 | 6 7
    rank 0 holds      0 1             6 7
    rank 1 holds            2 3   4 5

Everything that is per token follows the tokens (labels, loss mask, position ids, document
ids): :func:`slice_batch` cuts a micro-batch for this rank. Attention kernels use
:func:`chunk_positions` for the global position of each local query and key (the causal
mask), and tests put the pieces back together with :func:`unshuffle`.
"""

from __future__ import annotations

import torch

# per-token batch entries ([b, s]; the rolled ones of multi-token prediction [N, b, s],
# megalite.transformer.mtp) that :func:`slice_batch` cuts along the last dim; others pass
# unchanged
PER_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "mtp_tokens",
                  "mtp_labels", "mtp_loss_mask")


def with_document_ids(batch: dict) -> dict:
    """Replace a data loader's ``attention_mask`` (bool ``[b, 1, s, s]``, True where masked:
    ``--reset-attention-mask``) by ``document_ids`` int64 ``[b, s]``: for each token the
    position where its document starts (the first key its mask row allows). Attention
    kernels rebuild "causal and same document" from these ``s`` numbers instead of moving
    an ``s x s`` mask around."""
    if "attention_mask" not in batch:
        return batch
    out = dict(batch)
    allowed = ~out.pop("attention_mask").reshape(-1, *batch["tokens"].shape[-1:] * 2)
    out["document_ids"] = allowed.to(torch.int8).argmax(dim=-1).to(torch.int64)
    return out


def check_divisible(seq_length: int, cp: int) -> None:
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x "
                         f"context_parallel_size ({2 * cp})")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices rank ``rank`` of ``cp`` holds: ``(r, 2cp - 1 - r)``."""
    return rank, 2 * cp - 1 - rank


def chunk_positions(seq_length: int, cp: int, rank: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """Global positions (int64 ``[s / cp]``) of the tokens rank ``rank`` holds, in its local
    order. ``seq_length`` is the full sequence length ``s``."""
    check_divisible(seq_length, cp)
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(cp, rank)])


def rank_order(seq_length: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (``[s]``) of the tokens in rank order: rank 0's local sequence,
    then rank 1's, ... (what an all-gather over cp of the local sequences holds)."""
    return torch.cat([chunk_positions(seq_length, cp, r, device) for r in range(cp)])


def slice_batch(batch: dict, cp: int, rank: int) -> dict:
    """This cp rank's part of a micro-batch of ``[b, s]`` tensors (:data:`PER_TOKEN_KEYS`).

    Position ids ``0..s-1`` are added when the batch has none, so that RoPE and learned
    positions see the global position of each token. ``document_ids`` ``[b, s]`` (if
    present) stay whole: every rank's keys can come from anywhere in the sequence.
    """
    if cp == 1:
        return batch
    tokens = batch["tokens"]
    seq = tokens.shape[1]
    index = chunk_positions(seq, cp, rank, tokens.device)
    out = dict(batch)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq, device=tokens.device).expand_as(tokens)
    for key in PER_TOKEN_KEYS:
        if key in out:
            out[key] = out[key].index_select(-1, index)
    return out


def unshuffle(pieces: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Inverse of the layout: every cp rank's local tensor (rank order, sequence along
    ``dim``) -> the full sequence in global order."""
    cp = len(pieces)
    full = torch.cat(pieces, dim=dim)
    order = rank_order(full.shape[dim], cp, full.device)
    return full.index_select(dim, torch.argsort(order))
