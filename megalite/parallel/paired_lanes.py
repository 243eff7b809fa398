"""Two micro-batches taking turns at communication points (the MoE all-to-all overlap).

:func:`run_paired` runs ``main()`` (a backward) on the calling thread and ``side()`` (the
next micro-batch's forward) on a helper thread, one at a time: exactly one lane computes
while the other waits for its turn, so the two never run Python or torch code at once and
every rank issues its collectives in the same order (the lanes switch at the same points
on every rank). A lane switches in :func:`exchange`: it launches an asynchronous
collective (``async_op=True``), hands the turn to the other lane, and when the turn comes
back waits for the collective -- which ran on the backend's own thread while the other
lane computed. That is Megatron-LM's batch-level overlap (its "combined 1F1B") at the
granularity of whole lane segments: the backward's combine / dispatch all-to-all of layer
``l`` overlaps the forward from one all-to-all to the next, and the reverse.

Results are those of running ``main()`` then ``side()``: the same operations on the same
tensors, only interleaved; a forward accumulates no gradient, so each parameter still
receives its gradients in micro-batch order. A lane that finishes hands the turn over for
good; the other then runs to its end without switching.

:data:`STATS` accumulates, for every all-to-all that went through :func:`exchange` or was
timed with :func:`timed` (the blocking path), the seconds from issue to completion as
the issuing lane saw it and the seconds that lane spent blocked on it: ``blocked /
span`` is the exposed share, and comparing the blocked seconds of an overlapped run with
those of the same run without the overlap gives the hidden fraction
(``tools/bench/moe.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ExchangeStats:
    """All-to-alls seen by :func:`exchange` / :func:`timed` (seconds)."""

    calls: int = 0
    overlapped: int = 0        # of them with other work while in flight: issued inside a
                               # pair with the other lane alive, or given a side job
    span: float = 0.0          # issue -> completion seen by the issuing lane
    blocked: float = 0.0       # time the issuing lane spent waiting for it

    def reset(self) -> None:
        self.calls = self.overlapped = 0
        self.span = self.blocked = 0.0


STATS = ExchangeStats()


class _Pair:
    def __init__(self):
        self.cond = threading.Condition()
        self.turn = "main"
        self.done = {"main": False, "side": False}
        self.switches = 0
        self.side_thread: int | None = None


_pair: _Pair | None = None


def _lane_name(pair: _Pair) -> str:
    """The lane the calling thread works for: the helper thread is the side lane; any
    other is the main lane (on a GPU autograd runs the backward on its own device thread,
    on behalf of the main lane, which waits in ``backward()`` meanwhile)."""
    return "side" if threading.get_ident() == pair.side_thread else "main"


def active() -> bool:
    """Whether a pair is running (its lanes hand over at each :func:`exchange`)."""
    pair = _pair
    return pair is not None and not pair.done[_lane_name(pair)]


def _hand_over(pair: _Pair, me: str) -> None:
    """Give the turn to the other lane (if it has not finished) and wait to get it back."""
    other = "side" if me == "main" else "main"
    with pair.cond:
        if pair.done[other]:
            return
        pair.turn = other
        pair.switches += 1
        pair.cond.notify_all()
        pair.cond.wait_for(lambda: pair.turn == me)


def _finish(pair: _Pair, me: str) -> None:
    other = "side" if me == "main" else "main"
    with pair.cond:
        pair.done[me] = True
        pair.turn = other
        pair.cond.notify_all()


def exchange(launch: Callable[[], tuple[torch.Tensor, object]],
             side: Callable[[], None] | None = None) -> torch.Tensor:
    """Run the collective ``launch()`` returns as ``(output, work)``: call ``side()``
    (this lane's own work that does not need the output, e.g. the shared experts of
    ``--moe-shared-expert-overlap``) while it is in flight, then inside a pair let the
    other lane compute before waiting on ``work``; outside a pair, wait."""
    t0 = time.perf_counter()
    out, work = launch()
    overlapped = side is not None
    if side is not None:
        side()
    pair = _pair
    if pair is not None:
        me = _lane_name(pair)
        if not pair.done[me] and not pair.done["side" if me == "main" else "main"]:
            overlapped = True
            _hand_over(pair, me)
    t1 = time.perf_counter()
    work.wait()
    t2 = time.perf_counter()
    STATS.calls += 1
    STATS.overlapped += overlapped
    STATS.span += t2 - t0
    STATS.blocked += t2 - t1 if overlapped else t2 - t0   # the side work is hidden time
    return out


def timed(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A blocking all-to-all ``fn()``, counted in :data:`STATS` as fully exposed."""
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    STATS.calls += 1
    STATS.span += dt
    STATS.blocked += dt
    return out


def run_paired(main: Callable[[], None], side: Callable[[], None]) -> int:
    """Run ``main`` on this thread and ``side`` on a helper thread, taking turns at every
    :func:`exchange` (``main`` first); returns how many times the turn changed hands.
    An exception in either lane is raised here after both have stopped."""
    global _pair
    if _pair is not None:
        raise RuntimeError("run_paired does not nest")
    pair = _Pair()
    errors: list[BaseException] = []
    # thread-local state the side lane must share with this one: grad mode, and on a GPU
    # the current device (a new thread starts on cuda:0 whatever this rank's device is)
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def side_lane():
        with pair.cond:
            pair.cond.wait_for(lambda: pair.turn == "side")
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                side()
        except BaseException as exc:   # re-raised on the main thread
            errors.append(exc)
        finally:
            _finish(pair, "side")

    _pair = pair
    helper = threading.Thread(target=side_lane, name="megalite-paired-forward", daemon=True)
    helper.start()
    pair.side_thread = helper.ident
    try:
        main()
    except BaseException as exc:
        errors.insert(0, exc)
    finally:
        _finish(pair, "main")
        helper.join()
        _pair = None
    if errors:
        raise errors[0]
    return pair.switches
