"""When each pipeline transfer is posted: every rank's steps laid out in lockstep rounds.

NCCL matches point-to-point messages between two ranks by posting order alone (it has no
tags), and a send may block until the peer posted the matching receive. So the transfers
must be posted in an order that (1) pairs the k-th send on every directed channel
``src -> dst`` with the k-th receive posted on ``dst`` from ``src``, and (2) never leaves
two ranks blocked on sends to each other. With two stages both of a rank's channels lead
to the same peer (activations and gradients share it), and the interleaved schedule's
activations wrap around from the last stage to the first stage's next chunk.

:func:`plan_rounds` meets both by construction. It plays every rank's step list in
lockstep rounds: in a round each rank runs its next step if that step's input arrived in
an earlier round (else it idles), and at the end of the round every output goes to the
rank whose step consumes it. Each rank's round then becomes one batch of point-to-point
ops (:meth:`megalite.pipeline.p2p.PipeComm.exchange`): the send of the step it ran and
the receives of every message addressed to it in that round. Every op's match is in the
peer's batch of the same round, so once all ranks have finished round ``t - 1``, all
batches of round ``t`` can complete together (no deadlock, even when every op blocks until
matched), and a directed channel carries at most one message per round, so messages are
received in the order they were sent (no tags needed). A rank posts its rounds in order;
rounds where it neither computes nor communicates are left out of its list.

Each rank runs its own steps in its own order, so the arithmetic is the same as without
the plan; only where a rank waits changes. A W step (a deferred weight gradient of the
zero-bubble schedules, :mod:`megalite.pipeline.zero_bubble`) neither waits for nor sends
anything: it takes a round of its rank and no transfer.

Where the pieces sit. The model is cut into ``p * v`` consecutive pieces. Interleaved (the
default placement) piece ``c * p + r`` is chunk ``c`` of rank ``r``, so activations always
flow to rank ``r + 1`` (wrapping around from the last rank to the first rank's next chunk).
The V placement of ZB-V (``v_shape``, two chunks per rank) puts piece ``r`` on chunk 0 of
rank ``r`` and piece ``2p - 1 - r`` on its chunk 1: activations go down the ranks in chunk
0, turn on the last rank (its chunk 0 feeds its own chunk 1, no transfer: a ``local``
round), and come back up in chunk 1 to rank 0, which holds the first and the last layers.
"""

from __future__ import annotations

from dataclasses import dataclass

Step = tuple[str, int, int]  # ("F" | "B" | "W", chunk, microbatch)


class ScheduleError(RuntimeError):
    """The pipeline ranks' step lists cannot all finish (a step waits for an input that no
    rank will send)."""


def piece_of(rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Position in the whole model of ``chunk`` of pipeline rank ``rank``."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def place(piece: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """(pipeline rank, chunk) holding ``piece``; the inverse of :func:`piece_of`."""
    if v_shape:
        return (piece, 0) if piece < pp else (2 * pp - 1 - piece, 1)
    return piece % pp, piece // pp


@dataclass(frozen=True)
class Round:
    """One round of one pipeline rank.

    step: the step it runs this round (None: it waits for an input).
    sends: whether the step's output leaves for another rank at the end of the round
        (an activation to the next stage, a gradient to the previous one).
    recvs: the rank's later steps whose input arrives at the end of the round, forward
        ones (activation from the previous stage) first; at most one each.
    send_to: the pipeline rank the output goes to (when ``sends``).
    recv_from: the pipeline rank each of ``recvs`` comes from.
    local: the step's output feeds a later step of the same rank (the turn of the V
        placement): kept, not sent.
    """

    step: Step | None
    sends: bool
    recvs: tuple[Step, ...]
    send_to: int | None = None
    recv_from: tuple[int, ...] = ()
    local: bool = False


def destination(step: Step, rank: int, pp: int, vpp: int,
                v_shape: bool = False) -> tuple[int, Step] | None:
    """(rank, step) consuming the output of ``step`` run on ``rank``, or None (the output
    is the loss of the last piece, or the gradient of the first piece's input)."""
    kind, chunk, mb = step
    if kind == "W":  # a deferred weight gradient: nothing leaves the rank
        return None
    piece = piece_of(rank, chunk, pp, v_shape)  # position of this piece in the model
    target = piece + 1 if kind == "F" else piece - 1
    if not 0 <= target < pp * vpp:
        return None
    dest_rank, dest_chunk = place(target, pp, v_shape)
    return dest_rank, (kind, dest_chunk, mb)


def needs_input(step: Step, rank: int, pp: int, vpp: int, v_shape: bool = False) -> bool:
    """Whether ``step`` waits for another step's output (an activation or a gradient)."""
    kind, chunk, _ = step
    if kind == "W":  # its input is this rank's own B step, run before it
        return False
    piece = piece_of(rank, chunk, pp, v_shape)
    return piece > 0 if kind == "F" else piece < pp * vpp - 1


def plan_rounds(rank_steps: list[list[Step]], vpp: int,
                v_shape: bool = False) -> list[list[Round]]:
    """The rounds of every pipeline rank (index: pipeline rank), see the module docstring.

    rank_steps: each pipeline rank's steps in execution order; vpp: model chunks per rank;
    v_shape: the V placement of the pieces (ZB-V), else interleaved.
    """
    pp = len(rank_steps)
    pos = [0] * pp
    arrived: set[tuple[int, Step]] = set()
    rounds: list[list[Round]] = [[] for _ in range(pp)]
    while any(pos[r] < len(rank_steps[r]) for r in range(pp)):
        ran: list[Step | None] = [None] * pp
        for r in range(pp):
            if pos[r] == len(rank_steps[r]):
                continue
            step = rank_steps[r][pos[r]]
            if not needs_input(step, r, pp, vpp, v_shape) or (r, step) in arrived:
                ran[r] = step
                pos[r] += 1
        if not any(ran):
            raise ScheduleError(f"pipeline ranks stuck at steps {pos} of "
                                f"{[len(s) for s in rank_steps]}: each waits for an input "
                                "no rank sends; the step lists do not fit together")
        send_to: list[int | None] = [None] * pp
        local = [False] * pp
        recvs: list[list[tuple[Step, int]]] = [[] for _ in range(pp)]
        for r, step in enumerate(ran):
            dest = destination(step, r, pp, vpp, v_shape) if step else None
            if dest:
                arrived.add(dest)
                if dest[0] == r:   # the turn of the V: stays on the rank
                    local[r] = True
                else:
                    send_to[r] = dest[0]
                    recvs[dest[0]].append((dest[1], r))
        for r in range(pp):
            if ran[r] or recvs[r]:
                recvs[r].sort(key=lambda s: s[0][0] != "F")
                rounds[r].append(Round(ran[r], send_to[r] is not None, tuple(
                    s for s, _ in recvs[r]), send_to[r], tuple(src for _, src in recvs[r]),
                    local[r]))
    return rounds
