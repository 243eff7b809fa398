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
round every directed channel carries at most one message, and the matching op of every
op sits in the peer's batch of the same round. So the k-th send on a channel always meets
the k-th receive, and the batches of a round complete together even when a send blocks
until its receive is posted (NCCL; gloo too: a gloo send completes only once matched).

By default a batch waits for its receives only and its sends complete in the background
(:meth:`reap`, :meth:`wait_all`). Setting ``MEGALITE_P2P_WAIT_SENDS=1`` (a test switch)
makes every batch wait for all of its ops, sends included, as an NCCL batch completes as
one unit: the schedules must not deadlock or mismatch either way.

Shapes are known ahead (``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism),
so no shape handshake is needed unless ``variable_seq_lengths`` is set; then each round
first exchanges the shapes (int64 ``[3]`` tensors on the rank's device) in a batch of
the same pattern, then the tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megalite.parallel import collectives

_SHAPE_DIMS = 3
WAIT_SENDS_ENV = "MEGALITE_P2P_WAIT_SENDS"


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

    def exchange(self, send: tuple[str, torch.Tensor] | None,
                 recv: Sequence[str]) -> list[torch.Tensor]:
        """One round's transfers, posted together as one batch.

        send: ``("F", activation)`` for the next stage, ``("B", input_grad)`` for the
            previous stage, or None.
        recv: the kinds to receive, forward first: ``"F"`` an activation from the
            previous stage (returned with ``requires_grad``), ``"B"`` the gradient of
            this stage's output from the next stage.
        Returns the received tensors, in the order of ``recv``.
        """
        start = time.perf_counter()
        sends = []
        if send is not None:
            kind, tensor = send
            sends = [(tensor.detach().contiguous(),
                      self.next_rank if kind == "F" else self.prev_rank)]
        peers = [self.prev_rank if kind == "F" else self.next_rank for kind in recv]
        shapes = [self.shape] * len(peers)
        if self.variable:
            sizes = [torch.tensor(t.shape, dtype=torch.int64, device=self.device)
                     for t, _ in sends]
            bufs = [torch.empty(_SHAPE_DIMS, dtype=torch.int64, device=self.device)
                    for _ in peers]
            self._batch([(s, peer) for s, (_, peer) in zip(sizes, sends)],
                        list(zip(bufs, peers)))
            shapes = [tuple(b.tolist()) for b in bufs]
        bufs = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        self._batch(sends, list(zip(bufs, peers)))
        self.wait_seconds += time.perf_counter() - start
        return [b.requires_grad_() if kind == "F" else b for b, kind in zip(bufs, recv)]

    def _batch(self, sends: list[tuple[torch.Tensor, int]],
               recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post ``sends`` then ``recvs`` ((tensor, global peer rank) pairs, no tags) as one
        batch on ``ps.pp``; return once the receives (and with ``wait_sends`` the sends)
        completed."""
        if not sends and not recvs:
            return
        # tracked works: a peer that stopped or died raises the watchdog's one-line error
        works = collectives.batch_isend_irecv(sends, recvs, self.pp)
        if self.wait_sends or len(works) != len(sends) + len(recvs):  # one work per batch
            for work in works:
                work.wait()
            return
        self.pending += [(w, t) for w, (t, _) in zip(works, sends)]
        for work in works[len(sends):]:
            work.wait()

    # -- completion ---------------------------------------------------------------------
    def reap(self) -> None:
        """Forget sends that completed (their buffers may be reused)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
