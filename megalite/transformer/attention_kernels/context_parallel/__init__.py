"""Context-parallel attention: the sequence is split over ``ps.cp`` (``--context-parallel-size``)
in the load-balanced layout of :mod:`megalite.parallel.cp_chunks`, and attention exchanges
keys/values in one of Megatron-LM's ways (``--cp-comm-type``):

=============  ==========================================================================
``p2p``        ring attention: key/value blocks travel around the cp ring, partial results
               combine by log-sum-exp (``ring.py``); needs a kernel with an lse block
``allgather``  keys/values all-gathered over cp, queries stay local (``allgather.py``)
``a2a``        Ulysses: all-to-all from sequence-sharded to head-sharded and back
               (``ulysses.py``); heads and query groups per tp rank divisible by cp
=============  ==========================================================================

Each wraps the kernel of ``--attention-backend`` (``local``, ``sdpa``, ``flash``), which
computes the blocks (``blocks.py``).
"""

from __future__ import annotations

from megalite.config import ConfigError
from megalite.transformer.attention_kernels.base import CoreAttention
from megalite.transformer.attention_kernels.context_parallel.allgather import AllGatherAttention
from megalite.transformer.attention_kernels.context_parallel.base import ContextParallelAttention
from megalite.transformer.attention_kernels.context_parallel.ring import RingAttention
from megalite.transformer.attention_kernels.context_parallel.ulysses import UlyssesAttention

CP_KERNELS: dict[str, type[ContextParallelAttention]] = {
    "p2p": RingAttention,
    "allgather": AllGatherAttention,
    "a2a": UlyssesAttention,
}

__all__ = ["CP_KERNELS", "ContextParallelAttention", "build_context_parallel_attention"]


def build_context_parallel_attention(base: CoreAttention, comm_type: str,
                                     ps) -> ContextParallelAttention:
    """``base`` (this rank's kernel) wrapped for ``--cp-comm-type comm_type`` over ``ps.cp``;
    :class:`ConfigError` when the pair cannot work."""
    if comm_type not in CP_KERNELS:
        raise ConfigError(f"unknown --cp-comm-type {comm_type!r}; use one of "
                          f"{', '.join(CP_KERNELS)}")
    if comm_type == "p2p" and type(base).lse_block is None:
        able = ", ".join(n for n, k in _kernels().items() if k.lse_block is not None)
        raise ConfigError(f"--attention-backend {base.name} cannot return the log-sum-exp "
                          f"that --cp-comm-type p2p (ring attention) needs; use "
                          f"--attention-backend {able}, or --cp-comm-type allgather or a2a")
    return CP_KERNELS[comm_type](base, ps)


def _kernels() -> dict:
    from megalite.transformer.attention_kernels import KERNELS

    return KERNELS
