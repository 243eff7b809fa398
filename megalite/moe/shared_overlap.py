"""``--moe-shared-expert-overlap``: the shared experts' forward runs while the token
dispatch's all-to-all is in flight.

Megatron-LM runs the shared experts on a side CUDA stream so that their GEMMs overlap the
dispatcher's communication. megalite does it with a :class:`SideJob`: the MoE layer wraps
``shared_experts(hidden)`` (``[s, b, h]`` -> ``[s, b, h]``, its own collectives over
``ps.tp``) in a job and hands it to the alltoall dispatcher, whose forward dispatch
all-to-all over ``ps.ep`` launches asynchronously (``async_op=True``), runs the job, and
only then waits for the exchange (:func:`megalite.moe.comm.all_to_all`,
:func:`megalite.parallel.paired_lanes.exchange`). The same operations run on the same
tensors as without the flag, only earlier, so losses and gradients are bitwise the same.

Only the forward's dispatch is overlapped; backward runs in autograd's order as without
the flag. With ``ps.ep`` of one rank there is no all-to-all and the job runs after the
routed experts, as without the flag (:meth:`SideJob.take`). Under
``--recompute-modules moe`` the checkpointed part (dispatch, experts, shared experts) runs
again in backward, with the job again inside the dispatch all-to-all: the recomputed
forward saves its tensors in the same order as the first one.

The dispatch's exchange runs inside an autograd function's ``forward``, where grad mode is
off; the job records autograd there when grad mode was on where the job was made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SideJob:
    """A computation ``fn()`` to run once while a collective is in flight.

    ``run()`` (called by the collective between launch and wait) computes it under the
    grad mode of the job's creation; ``take()`` returns the result, computing it first
    when no collective ran it (a one-rank group); ``overlapped`` says whether a
    collective ran it.
    """

    __slots__ = ("fn", "grad", "result", "done", "overlapped")

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn
        self.grad = torch.is_grad_enabled()
        self.result: torch.Tensor | None = None
        self.done = False
        self.overlapped = False

    def _compute(self) -> None:
        with torch.set_grad_enabled(self.grad):
            self.result = self.fn()
        self.done = True

    def run(self) -> None:
        """Compute now (inside a collective); at most once."""
        if not self.done:
            self._compute()
            self.overlapped = True

    def take(self) -> torch.Tensor:
        """The result, computed now if no collective has run the job."""
        if not self.done:
            self._compute()
        return self.result
