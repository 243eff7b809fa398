"""Token dispatchers: bring each token to the ranks holding its experts and back.

Both take this rank's tokens ``x`` ``[T, h]`` with the router's ``probs`` / ``routing_map``
``[T, E]`` and return ``[T, h]``: the sum over the chosen experts of
``prob * expert(token)``. Probabilities are applied here, on the token's own rank, after
the expert outputs come back. Groups: ``ps.ep`` (expert parallel, ``E_l = E / ep``
experts per rank) and ``ps.etp`` (expert tensor parallel).

``alltoall`` (``--moe-token-dispatcher-type alltoall``), per forward::

    permute by expert  [T, h] -> [N, h]            (N = T * k when dropless)
    exchange counts    all_to_all_single [ep, E_l] int64 over ep
    dispatch           all_to_all_single, uneven splits, over ep -> [M, h]
    sort               (source rank, expert) -> (expert, source rank)
    [etp > 1]          uneven all-gather over etp; experts; uneven reduce-scatter over etp
    local experts      grouped GEMM
    unsort, combine    all_to_all_single back over ep -> [N, h]
    unpermute          index_add weighted by probs -> [T, h]

``allgather``: all-gather ``x``, ``probs`` and ``routing_map`` over ep (``[ep * T, ...]``),
run the local experts on the tokens routed to them, scatter the weighted outputs back into
``[ep * T, h]`` and reduce-scatter over ep. It moves ``T * h`` per peer whatever k, so it
wins only when ``k * (ep - 1) / ep`` exceeds ``ep - 1``, i.e. hardly ever beyond ep = 2.

Bytes sent to other ranks in forward are added to ``dispatcher.counter``
(:class:`megalite.moe.comm.CommCounter`).
"""

from __future__ import annotations

import torch

from megalite.moe import comm
from megalite.parallel import mappings


def permute(x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Copy each token once per expert it goes to, grouped by expert (token order within).

    ``x`` ``[T, h]``, ``probs`` / ``routing_map`` ``[T, E]`` -> (tokens ``[N, h]``,
    token_index ``[N]`` (source row), token_probs ``[N]``, counts ``[E]`` int64).
    """
    by_expert = routing_map.t()  # [E, T]
    token_index = by_expert.nonzero()[:, 1]
    token_probs = probs.t()[by_expert]
    counts = by_expert.sum(1, dtype=torch.int64)
    return x.index_select(0, token_index), token_index, token_probs, counts


def unpermute(y: torch.Tensor, token_index: torch.Tensor, token_probs: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """``[N, h]`` expert outputs -> ``[num_tokens, h]``: ``sum prob * output`` per token."""
    weighted = y * token_probs.unsqueeze(-1).to(y.dtype)
    return y.new_zeros(num_tokens, y.shape[-1]).index_add(0, token_index, weighted)


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), device=index.device)
    return inv


class _Dispatcher:
    """Shared part: the local expert computation, with the etp exchange around it."""

    def __init__(self, num_experts: int, ps, counter: comm.CommCounter):
        self.ep, self.etp = ps.ep, ps.etp
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep.size
        self.first_expert = self.ep.rank * self.num_local
        self.counter = counter

    def run_experts(self, tokens: torch.Tensor, chunk_counts: torch.Tensor,
                    experts) -> torch.Tensor:
        """``tokens`` ``[M, h]`` in chunks ``chunk_counts`` ``[A, E_l]`` (source-major)
        -> expert outputs ``[M, h]`` in the same order."""
        chunk_counts = chunk_counts.cpu()
        sort = None
        if chunk_counts.shape[0] > 1:
            sort = comm.sort_chunks_index(chunk_counts).to(tokens.device)
            tokens = tokens.index_select(0, sort)
        per_expert = chunk_counts.sum(0)
        if self.etp.size == 1:
            out = experts(tokens, per_expert)
        else:
            out = self._run_expert_tensor_parallel(tokens, per_expert, experts)
        return out if sort is None else out.index_select(0, _inverse(sort))

    def _run_expert_tensor_parallel(self, tokens, per_expert, experts):
        """Gather every etp rank's expert-sorted tokens (uneven, over etp), run this
        rank's shard of the experts, reduce-scatter the partial outputs back."""
        all_counts = comm.all_gather_stacked(per_expert.to(tokens.device), self.etp,
                                             self.counter, "etp_counts").cpu()  # [etp, E_l]
        sizes = all_counts.sum(1).tolist()
        gathered = comm.gather_uneven(tokens, sizes, self.etp, self.counter, "etp_gather")
        sort = comm.sort_chunks_index(all_counts).to(tokens.device)
        out = experts(gathered.index_select(0, sort), all_counts.sum(0))
        out = out.index_select(0, _inverse(sort))
        return comm.scatter_reduce_uneven(out, sizes, self.etp, self.counter,
                                          "etp_reduce_scatter")


class AllToAllDispatcher(_Dispatcher):
    """Uneven all-to-all over ``ps.ep`` (see the module docstring)."""

    def __call__(self, x, probs, routing_map, experts, side=None) -> torch.Tensor:
        """``side``: a :class:`megalite.moe.shared_overlap.SideJob` run while the dispatch
        all-to-all is in flight (at ep 1 it is left to the caller)."""
        tokens, token_index, token_probs, counts = permute(x, probs, routing_map)
        ep, counter = self.ep, self.counter
        counts = counts.view(ep.size, self.num_local)
        recv_counts = comm.exchange_counts(counts, ep, counter)  # [ep, E_l] from each rank
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        tokens = comm.all_to_all(tokens, send, recv, ep, counter, "dispatch", side=side)
        out = self.run_experts(tokens, recv_counts, experts)
        out = comm.all_to_all(out, recv, send, ep, counter, "combine")
        return unpermute(out, token_index, token_probs, x.shape[0])


class AllGatherDispatcher(_Dispatcher):
    """All-gather over ``ps.ep``, local experts, reduce-scatter over ``ps.ep``."""

    def __call__(self, x, probs, routing_map, experts, side=None) -> torch.Tensor:
        """``side`` is not run here (no all-to-all to hide it behind): the caller takes
        it after."""
        ep = self.ep
        if ep.size > 1:
            peers = ep.size - 1
            self.counter.add("dispatch", x.numel() * x.element_size() * peers)
            self.counter.add("probs", probs.numel() * probs.element_size() * peers)
            # the sequence-parallel gather / reduce-scatter, run along dim 0 on the ep group
            x = mappings.gather_from_sequence_parallel_region(x, ep)
            probs = mappings.gather_from_sequence_parallel_region(probs, ep)
            routing_map = comm.all_gather_stacked(routing_map.to(torch.uint8), ep,
                                                  self.counter, "routing_map")
            routing_map = routing_map.view(-1, self.num_experts).bool()
        local = slice(self.first_expert, self.first_expert + self.num_local)
        tokens, token_index, token_probs, counts = permute(x, probs[:, local],
                                                           routing_map[:, local])
        out = self.run_experts(tokens, counts.unsqueeze(0), experts)
        out = unpermute(out, token_index, token_probs, x.shape[0])
        if ep.size > 1:
            self.counter.add("combine", out.numel() * out.element_size() * (ep.size - 1)
                             // ep.size)
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, ep)
        return out


# Megatron's flex dispatcher (DeepEP / HybridEP kernels) moves the same tokens as alltoall;
# megalite runs it as alltoall and names it at start-up (ModelConfig's no_effect_values)
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher,
               "flex": AllToAllDispatcher}
