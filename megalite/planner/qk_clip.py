"""What ``--qk-clip`` / ``--log-max-attention-logit`` add to a step: the extra pass over
the attention scores that finds each head's largest logit
(:mod:`megalite.transformer.max_logits`) and its collectives.

In every training forward of an attention layer (decoder layers and multi-token prediction
depths; again in the recomputed forward under full recomputation, which re-runs the
layer's attention before the checkpoint stops, and under multi-latent attention's
recomputed up projections and kernel: :func:`layer_passes`),
:class:`~megalite.transformer.max_logits.MaxLogitTracker` forms ``q . k * scale`` for
**all** (query, key) pairs of the rank's queries and then masks them (the causal mask
saves nothing), in fp32, without gradients:

* **FLOPs** -- ``2 nh d_qk s^2`` per sequence and layer pass (heads over tp; under cp each
  rank's ``s/cp`` queries against all ``s`` keys, so the same total), forward only, at the
  cluster's fp32 matmul rate (:attr:`~megalite.planner.cluster.Cluster.fp32_flops`).
* **memory-bound** -- each fp32 score is written by the einsum, read and written by the
  scale, read and written by the mask, read by the max: :data:`SCORE_PASSES` x 4 bytes.
* **cp** -- the keys ``[s/cp, b, key heads / tp, d_qk]`` all-gathered over ``ps.cp`` (in
  the training dtype) per layer pass: ``cp - 1`` chunks sent per rank, blocking.
* **once per step** -- one MAX all-reduce over dp x cp of every local layer's ``[nh/tp]``
  fp32 maxima (:func:`megalite.optim.qk_clip.step_max_logits`) and one scalar MAX over the
  world (the logged value).

Nothing is kept for backward; the pass's working set is transient
(:func:`transient_bytes`).
"""

from __future__ import annotations

from megalite.config.shapes import attention_head_dims, mtp_depths
from megalite.transformer.max_logits import CHUNK_ELEMENTS

SCORE_PASSES = 6   # fp32 score traffic: einsum write, scale read + write, mask read +
                   # write, max read


def enabled(m) -> bool:
    """Whether the layers track their largest logits (``--qk-clip`` or
    ``--log-max-attention-logit``)."""
    return bool(m.qk_clip or m.log_max_attention_logit)


def layer_passes(m) -> int:
    """Training forwards of each attention layer's pass per micro-batch: 2 where backward
    recomputes it -- full recomputation, or multi-latent attention recomputing both
    ``mla_up_proj`` and ``core_attn`` (one checkpoint around up projections, the pass and
    the kernel) -- else 1."""
    if m.recompute_granularity == "full":
        return 2
    mla_both = m.multi_latent_attention and m.recompute_granularity == "selective" and \
        m.recomputes("mla_up_proj") and m.recomputes("core_attn")
    return 2 if mla_both else 1


def attention_layers(m) -> int:
    """Attention layers that track: the decoder's and the multi-token prediction
    depths'."""
    return m.num_layers + mtp_depths(m)


def key_heads(m) -> int:
    """Key heads the pass reads: the query groups, or every head under multi-latent
    attention (its keys are per head)."""
    return m.num_attention_heads if m.multi_latent_attention else m.num_query_groups


def score_elements_per_sequence(m) -> float:
    """fp32 scores the pass forms per sequence per step (all layers and passes):
    ``nh s^2`` per layer pass."""
    if not enabled(m):
        return 0.0
    return float(layer_passes(m) * attention_layers(m) * m.num_attention_heads
                 * m.seq_length ** 2)


def flops_per_sequence(m) -> float:
    """FLOPs of the pass per sequence per step: ``2 d_qk`` per score (the query-key
    products, ``d_qk`` the query/key head width)."""
    d_qk, _ = attention_head_dims(m)
    return 2.0 * d_qk * score_elements_per_sequence(m)


def gather_bytes_per_microbatch(m, tp: int, cp: int, micro_batch: int,
                                dtype_bytes: int) -> float:
    """Bytes one rank sends in one attention layer pass's key all-gather over cp for one
    micro-batch: ``cp - 1`` local key chunks ``[s/cp, b, key heads / tp, d_qk]`` (times
    the rank's layers and :func:`layer_passes` per micro-batch); 0 without cp or
    tracking."""
    if not enabled(m) or cp == 1:
        return 0.0
    d_qk, _ = attention_head_dims(m)
    local = m.seq_length // cp * micro_batch * key_heads(m) // tp * d_qk * dtype_bytes
    return float((cp - 1) * local)


def transient_bytes(m, tp: int, cp: int, micro_batch: int, dtype_bytes: int) -> float:
    """The pass's working set in one layer's forward: two query chunks of fp32 scores
    ``[b, nh/tp, rows, s]`` (the product and its scaled / masked successor; ``rows`` so
    that a chunk holds at most :data:`CHUNK_ELEMENTS` floats, at least one row), the fp32
    copies of this rank's queries ``[b, nh/tp, s/cp, d_qk]`` and of the keys ``[b, key
    heads/tp, s, d_qk]``, and under cp the gathered keys in the training dtype."""
    if not enabled(m):
        return 0.0
    d_qk, _ = attention_head_dims(m)
    nh, ng = m.num_attention_heads // tp, key_heads(m) // tp
    sq, sk, b = m.seq_length // cp, m.seq_length, micro_batch
    rows = min(sq, max(1, CHUNK_ELEMENTS // max(1, b * nh * sk)))
    scores = 2 * rows * b * nh * sk * 4
    copies = (sq * nh + sk * ng) * b * d_qk * 4
    gathered = sk * b * ng * d_qk * dtype_bytes if cp > 1 else 0
    return float(scores + copies + gathered)
