"""Activation and gradient transfers between neighbouring pipeline stages.

Forward activations go from pipeline rank ``r`` to ``r + 1`` and gradients from ``r`` to
``r - 1``, both wrapping around (the interleaved schedule sends the last stage's chunk
``c`` output to the first stage's chunk ``c + 1``). With two stages both directions join
the same pair of ranks, so the two kinds of message carry different tags.

Sends are asynchronous (``isend``); a receive blocks until its tensor arrived. Shapes are
known ahead (``[s, b, h]``, or ``[s/tp, b, h]`` under sequence parallelism), so no shape
handshake is needed unless ``variable_seq_lengths`` is set. All transfers run on the
pipeline group ``ps.pp``; ``dst``/``src`` are global ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

FORWARD_TAG = 1
BACKWARD_TAG = 2
_SHAPE_DIMS = 3


class PipeComm:
    """Point-to-point transfers of one pipeline rank.

    tensor_shape: shape of every activation/gradient (e.g. ``[s, b, h]``).
    Keeps the pending sends so callers can free a sent tensor once it left, and
    accumulates the time spent blocked in receives (``wait_seconds``) for the bubble
    measurement.
    """

    def __init__(self, ps, tensor_shape, dtype: torch.dtype,
                 variable_seq_lengths: bool = False):
        self.group = ps.pp.group
        self.prev_rank, self.next_rank = ps.pipeline_neighbours()
        self.shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = ps.device
        self.variable = variable_seq_lengths
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.wait_seconds = 0.0

    # -- primitives ---------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if self.variable:
            shape = torch.tensor(tensor.shape, dtype=torch.int64)
            self.pending.append((dist.isend(shape, dst, group=self.group, tag=tag), shape))
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst, group=self.group, tag=tag), tensor))

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        shape = self.shape
        if self.variable:
            s = torch.empty(_SHAPE_DIMS, dtype=torch.int64)
            dist.irecv(s, src, group=self.group, tag=tag).wait()
            shape = tuple(s.tolist())
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.irecv(buf, src, group=self.group, tag=tag).wait()
        self.wait_seconds += time.perf_counter() - start
        return buf

    # -- the four transfers of a schedule -----------------------------------------------
    def recv_forward(self) -> torch.Tensor:
        """Activation from the previous stage; requires grad so its gradient can go back."""
        return self._recv(self.prev_rank, FORWARD_TAG).requires_grad_()

    def send_forward(self, output: torch.Tensor) -> None:
        self._send(output, self.next_rank, FORWARD_TAG)

    def recv_backward(self) -> torch.Tensor:
        """Gradient of this stage's output, from the next stage."""
        return self._recv(self.next_rank, BACKWARD_TAG)

    def send_backward(self, input_grad: torch.Tensor) -> None:
        self._send(input_grad, self.prev_rank, BACKWARD_TAG)

    # -- completion ---------------------------------------------------------------------
    def reap(self) -> None:
        """Forget sends that completed (their buffers may be reused)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

