"""Activation and gradient transfers between neighbouring pipeline stages.

Forward activations go from pipeline rank ``r`` to ``r + 1`` and gradients from ``r`` to
``r - 1``, both wrapping around (the interleaved schedule sends the last stage's chunk
``c`` output to the first stage's chunk ``c + 1``). All transfers run on the pipeline
group ``ps.pp``; peers are global ranks.

Ordering invariant (what makes this correct under NCCL). No op carries a tag: two
messages between the same pair of ranks are matched by posting order only, as NCCL does
(with two stages, activations and gradients share one pair of ranks). Transfers are
posted only through :meth:`PipeComm.exchange`, once per round of
:func:`megalite.pipeline.plan.plan_rounds`, as one ``batch_isend_irecv`` batch; in a
round every directed channel carries one message, or two where a paired backward and
forward (the MoE all-to-all overlap) both send to one peer -- the activation first on
both sides -- and the matching op of every op sits in the peer's batch of the same round.
So the k-th send on a channel always meets the k-th receive, and the batches of a round
complete together even when a send blocks until its receive is posted (NCCL; gloo too: a
gloo send completes only once matched).

By default nothing waits when a batch is posted: a step waits for its own input only
(:meth:`take`), so a rank runs ahead as far as its data allows, and sends complete in the
background (:meth:`reap`, :meth:`wait_all`). Setting ``MEGALITE_P2P_WAIT_SENDS=1`` (a
test switch) makes every batch complete, sends included, before the rank goes on -- the
strictest reading of NCCL, where a batch completes as one unit and the batches of a rank
run one after another: the schedules must not deadlock or mismatch either way.

Shapes are known ahead (``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism),
so no shape handshake is needed unless ``variable_seq_lengths`` is set; then each round
first exchanges the shapes (int64 ``[3]`` tensors on the rank's device) in a batch of
the same pattern, then the tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel import collectives

_SHAPE_DIMS = 3
WAIT_SENDS_ENV = "MEGALITE_P2P_WAIT_SENDS"


@dataclass
class Incoming:
    """A posted receive: ``tensor`` is filled once ``work`` completed (None: it has)."""

    tensor: torch.Tensor
    work: dist.Work | None
    activation: bool


class PipeComm:
    """Point-to-point transfers of one pipeline rank.

    tensor_shape: shape of every activation/gradient (e.g. ``[s, b, h]``).
    Keeps the pending sends so a sent tensor stays alive until it left, and accumulates
    the time spent blocked in transfers (``wait_seconds``) for the bubble measurement.
    """

    def __init__(self, ps, tensor_shape, dtype: torch.dtype,
                 variable_seq_lengths: bool = False):
        self.group = ps.pp.group
        self.pp = ps.pp
        self.prev_rank, self.next_rank = ps.pipeline_neighbours()
        self.shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = ps.device
        self.variable = variable_seq_lengths
        self.wait_sends = os.environ.get(WAIT_SENDS_ENV, "0") == "1"
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_seconds = 0.0

    def exchange(self, send: tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]] | None,
                 recv: Sequence[str], send_to: int | None | list[int | None] = None,
                 recv_from: Sequence[int] | None = None) -> list[Incoming]:
        """Post one round's transfers together, as one batch.

        send: ``("F", activation)`` for the next stage, ``("B", input_grad)`` for the
            previous stage, a list of them (a backward paired with a forward sends both,
            the activation first: two sends to one peer match the peer's receives in
            posting order), or None.
        recv: the kinds to receive, forward first: ``"F"`` an activation from the
            previous stage, ``"B"`` the gradient of this stage's output from the next
            stage.
        send_to, recv_from: the peers as pipeline ranks (indices into ``ps.pp``; a list
            with one entry per send when ``send`` is a list), where they are not the
            neighbours above (ZB-V's chunk 1 runs up the ranks: its activations go to the
            previous stage, its gradients to the next).
        Returns one :class:`Incoming` per ``recv``; :meth:`take` waits for its tensor.
        """
        start = time.perf_counter()
        if send is None:
            send, send_to = [], []
        elif not isinstance(send, list):
            send, send_to = [send], [send_to]
        elif send_to is None:
            send_to = [None] * len(send)
        sends = []
        for (kind, tensor), dst in zip(send, send_to, strict=True):
            peer = (self.pp.ranks[dst] if dst is not None
                    else self.next_rank if kind == "F" else self.prev_rank)
            sends.append((tensor.detach().contiguous(), peer))
        if recv_from is not None:
            peers = [self.pp.ranks[src] for src in recv_from]
        else:
            peers = [self.prev_rank if kind == "F" else self.next_rank for kind in recv]
        shapes = [self.shape] * len(peers)
        if self.variable:  # the receive buffers' shapes first, waited for at once
            sizes = [torch.tensor(t.shape, dtype=torch.int64, device=self.device)
                     for t, _ in sends]
            bufs = [torch.empty(_SHAPE_DIMS, dtype=torch.int64, device=self.device)
                    for _ in peers]
            for work in self._batch([(s, peer) for s, (_, peer) in zip(sizes, sends)],
                                    list(zip(bufs, peers))):
                if work is not None:
                    work.wait()
            shapes = [tuple(b.tolist()) for b in bufs]
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        works = self._batch(sends, list(zip(bufs, peers)))
        self.wait_seconds += time.perf_counter() - start
        return [Incoming(b, w, kind == "F") for b, w, kind in zip(bufs, works, recv)]

    def take(self, incoming: Incoming) -> torch.Tensor:
        """Wait for a received tensor (an activation comes back with ``requires_grad``)."""
        if incoming.work is not None:
            start = time.perf_counter()
            incoming.work.wait()
            incoming.work = None
            self.wait_seconds += time.perf_counter() - start
        return incoming.tensor.requires_grad_() if incoming.activation else incoming.tensor

    def _batch(self, sends: list[tuple[torch.Tensor, int]],
               recvs: list[tuple[torch.Tensor, int]]) -> list[dist.Work | None]:
        """Post ``sends`` then ``recvs`` ((tensor, global peer rank) pairs, no tags) as one
        batch on ``ps.pp``; returns the receives' works (None once complete: with
        ``wait_sends`` the whole batch has completed on return)."""
        if not sends and not recvs:
            return []
        # tracked works: a peer that stopped or died raises the watchdog's one-line error
        works = collectives.batch_isend_irecv(sends, recvs, self.pp)
        if self.wait_sends:  # each work waited for once (a gloo work waits per call)
            for work in works:
                work.wait()
            return [None] * len(recvs)
        if len(works) != len(sends) + len(recvs):  # NCCL coalescing: one work per batch
            self.pending += [(works[-1], t) for t, _ in sends]
            return [works[-1]] * len(recvs)
        self.pending += [(w, t) for w, (t, _) in zip(works, sends)]
        return works[len(sends):]

    # -- completion ---------------------------------------------------------------------
    def reap(self) -> None:
        """Forget sends that completed (their buffers may be reused)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
