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
matched), and a directed channel carries at most one message per round (two with the pairs
below, posted in one order on both sides), so messages are received in the order they
were sent (no tags needed). A rank posts its rounds in order; rounds where it neither
computes nor communicates are left out of its list.

Pairs (the MoE all-to-all overlap, ``--overlap-moe-expert-parallel-comm``). A backward and
the forward after it on one rank can run as one unit (:func:`pairs_of` chooses them from
the step lists alone, so every rank derives every rank's pairs alike): the unit takes one
round, runs once BOTH inputs arrived in earlier rounds (the backward's gradient from the
next stage, the forward's activation from the previous one) and sends both outputs at the
end of it -- 1F1B's steady-state "send forward, receive backward" shape. In 1F1B rank
``r`` runs ``F(w + i), B(i)`` with ``w = p - 1 - r`` warm-up forwards and pairs ``B(i)``
with ``F(w + i + 1)``; the unit of rank ``r - 1`` that produces ``F(w + i + 1)``'s input
holds ``B(i - 1)``, whose gradient rank ``r`` sent with its previous unit, so the pairs
wait in no cycle (the plan raises :class:`ScheduleError` if step lists and pairs ever
did). A round then carries up to two messages on one directed channel (with two stages,
or on the interleaved wrap-around, a pair's activation and gradient go to one peer); the
sender posts the activation first and the receiver's ``recvs`` list forward inputs first,
so order matching still pairs them. Without pairs the rounds are those above, unchanged.

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
    pair: the forward run together with ``step`` (a backward) as one unit (``pairs`` of
        :func:`plan_rounds`), or None.
    pair_sends, pair_send_to: whether the pair's forward output leaves, and to which
        pipeline rank; it is posted before the backward's (:meth:`outputs`).
    """

    step: Step | None
    sends: bool
    recvs: tuple[Step, ...]
    send_to: int | None = None
    recv_from: tuple[int, ...] = ()
    local: bool = False
    pair: Step | None = None
    pair_sends: bool = False
    pair_send_to: int | None = None

    def outputs(self) -> tuple[tuple[Step, int], ...]:
        """The steps whose output this round sends, in posting order, with the pipeline
        rank each goes to: a pair's forward first (as the receiver's ``recvs`` put
        activations first), then ``step``."""
        out = ()
        if self.pair_sends:
            out += ((self.pair, self.pair_send_to),)
        if self.sends:
            out += ((self.step, self.send_to),)
        return out


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


def pairs_of(rank_steps: list[list[Step]], vpp: int,
             v_shape: bool = False) -> tuple[tuple[int, ...], ...]:
    """The (backward, forward) pairs of every pipeline rank, for ``pairs`` of
    :func:`plan_rounds` (index: pipeline rank): the positions ``i`` in a rank's step list
    where the backward ``i`` runs together with the forward ``i + 1`` (the MoE all-to-all
    overlap, :mod:`megalite.parallel.paired_lanes`).

    Every backward that a forward directly follows, scanning left to right: in 1F1B's
    steady state ``F(w + i), B(i)`` (``w = p - 1 - r`` warm-up forwards on rank ``r``) that
    pairs ``B(i)`` with ``F(w + i + 1)``, all but the last backward of the steady state;
    interleaved 1F1B alike, over chunks. A function of the step lists alone, so every rank
    computes the same pairs for every rank. None for the V placement or split backwards
    (W steps: zero-bubble orders), whose steps are not paired.
    """
    if v_shape or any(s[0] == "W" for steps in rank_steps for s in steps):
        return tuple(() for _ in rank_steps)
    out = []
    for steps in rank_steps:
        mine, i = [], 0
        while i + 1 < len(steps):
            if steps[i][0] == "B" and steps[i + 1][0] == "F":
                mine.append(i)
                i += 2
            else:
                i += 1
        out.append(tuple(mine))
    return tuple(out)


def plan_rounds(rank_steps: list[list[Step]], vpp: int, v_shape: bool = False,
                pairs: tuple[tuple[int, ...], ...] | None = None) -> list[list[Round]]:
    """The rounds of every pipeline rank (index: pipeline rank), see the module docstring.

    rank_steps: each pipeline rank's steps in execution order; vpp: model chunks per rank;
    v_shape: the V placement of the pieces (ZB-V), else interleaved.
    pairs: per pipeline rank, the positions ``i`` whose backward ``i`` and forward ``i + 1``
    run as one unit (:func:`pairs_of`): one round that waits for both inputs and sends
    both outputs (``Round.pair``). None: every step alone.
    """
    pp = len(rank_steps)
    if pairs is not None and any(pairs):
        if v_shape:
            raise ValueError("pairs are not planned for the V placement")
        for r, at in enumerate(pairs):
            for i in at:
                if (i + 1 >= len(rank_steps[r]) or rank_steps[r][i][0] != "B"
                        or rank_steps[r][i + 1][0] != "F"):
                    raise ValueError(f"pair at step {i} of pipeline rank {r} is not a "
                                     "backward followed by a forward")
    starts = [frozenset(pairs[r]) if pairs else frozenset() for r in range(pp)]
    pos = [0] * pp
    arrived: set[tuple[int, Step]] = set()
    rounds: list[list[Round]] = [[] for _ in range(pp)]
    while any(pos[r] < len(rank_steps[r]) for r in range(pp)):
        ran: list[tuple[Step, ...]] = [()] * pp   # a step, or a (backward, forward) pair
        for r in range(pp):
            if pos[r] == len(rank_steps[r]):
                continue
            unit = tuple(rank_steps[r][pos[r]:pos[r] + (2 if pos[r] in starts[r] else 1)])
            if all(not needs_input(step, r, pp, vpp, v_shape) or (r, step) in arrived
                   for step in unit):
                ran[r] = unit
                pos[r] += len(unit)
        if not any(ran):
            raise ScheduleError(f"pipeline ranks stuck at steps {pos} of "
                                f"{[len(s) for s in rank_steps]}: each waits for an input "
                                "no rank sends; the step lists do not fit together")
        send_to: list[list[int | None]] = [[None, None] for _ in range(pp)]
        local = [False] * pp
        recvs: list[list[tuple[Step, int]]] = [[] for _ in range(pp)]
        for r, unit in enumerate(ran):
            for k, step in enumerate(unit):
                dest = destination(step, r, pp, vpp, v_shape)
                if not dest:
                    continue
                arrived.add(dest)
                if dest[0] == r:   # the turn of the V: stays on the rank
                    local[r] = True
                else:
                    send_to[r][k] = dest[0]
                    recvs[dest[0]].append((dest[1], r))
        for r in range(pp):
            if ran[r] or recvs[r]:
                # forward ones first: a pair's two outputs on one channel go F first
                recvs[r].sort(key=lambda s: s[0][0] != "F")
                step, pair = (ran[r] + (None, None))[:2]
                rounds[r].append(Round(
                    step, send_to[r][0] is not None, tuple(s for s, _ in recvs[r]),
                    send_to[r][0], tuple(src for _, src in recvs[r]), local[r], pair,
                    send_to[r][1] is not None, send_to[r][1]))
    return rounds
