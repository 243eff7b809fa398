"""Pipeline schedules: step lists are complete; their transfers match by order alone and
cannot deadlock when sends block (NCCL's semantics); gradients match."""

import itertools
import os

import pytest
import torch

from megalite.config import ConfigError
from megalite.config.layout import chunk_layer_ranges, layers_per_stage
from megalite.pipeline.p2p import WAIT_SENDS_ENV, PipeComm
from megalite.pipeline.plan import ScheduleError, pairs_of, plan_rounds
from megalite.pipeline.schedules import (
    ScheduleStats,
    build_schedule,
    build_schedules,
    interleaved_one_f_one_b,
    one_f_one_b,
    run_schedule,
)
from tests.distributed.harness import parallel_state, run_distributed


def _batches(rounds, r, p, v):
    """Rank ``r``'s point-to-point batches, one per round that communicates: each op is
    ("send" | "recv", peer, message), a message named by its sending piece and micro-batch
    (("F" | "B", piece, mb)); a pair's two sends in the order the round posts them."""
    out = []
    for rnd in rounds:
        ops = []
        for (kind, c, k), dst in rnd.outputs():
            assert dst == ((r + 1) % p if kind == "F" else (r - 1) % p)
            ops.append(("send", dst, (kind, c * p + r, k)))
        for kind, c, k in rnd.recvs:
            src_piece = c * p + r + (-1 if kind == "F" else 1)
            ops.append(("recv", src_piece % p, (kind, src_piece, k)))
        if ops:
            out.append(ops)
    return out


def nccl_matching(batches):
    """Run every rank's batches as NCCL would, tags ignored: a rank posts its next batch
    once every op of the current one completed; an op completes once its peer has posted
    the op at the same position of the same directed channel (k-th send from a to b with
    the k-th receive on b from a), which must carry the same message. Raises on a
    deadlock or a mismatch."""
    p = len(batches)
    pos, done = [0] * p, [set() for _ in range(p)]
    posted = {}  # (src, dst, "send" | "recv") -> messages posted so far, in order

    def channel(r, kind, peer):
        return (r, peer, kind) if kind == "send" else (peer, r, kind)

    def post(r):
        if pos[r] < len(batches[r]):
            for kind, peer, msg in batches[r][pos[r]]:
                posted.setdefault(channel(r, kind, peer), []).append(msg)

    for r in range(p):
        post(r)
    while any(pos[r] < len(batches[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(batches[r]):
                continue
            for i, (kind, peer, msg) in enumerate(batches[r][pos[r]]):
                src, dst, _ = key = channel(r, kind, peer)
                other = posted.get((src, dst, "recv" if kind == "send" else "send"), [])
                k = posted[key].index(msg)
                if k < len(other):
                    assert other[k] == msg, f"rank {r}: {kind} {msg} meets {other[k]}"
                    done[r].add(i)
            if len(done[r]) == len(batches[r][pos[r]]):
                pos[r], done[r], progressed = pos[r] + 1, set(), True
                post(r)
        if not progressed:
            raise AssertionError(f"deadlock at batches {pos}")


def live_peaks(rounds):
    """Peak number of micro-batches whose forward ran and backward did not, per rank."""
    peaks = []
    for rank_rounds in rounds:
        live = peak = 0
        for rnd in rank_rounds:
            if rnd.step is not None:
                live += 1 if rnd.step[0] == "F" else -1
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


CASES = [(p, v, m) for p, v, m in itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4],
                                                   [1, 2, 4, 8, 12, 16])
         if v == 1 or (p > 1 and m % p == 0)]


@pytest.mark.parametrize("p, v, m", CASES)
def test_schedule_is_complete_and_deadlock_free(p, v, m):
    for r in range(p):
        steps = build_schedule(p, r, m, v)
        fwd = [s[1:] for s in steps if s[0] == "F"]
        bwd = [s[1:] for s in steps if s[0] == "B"]
        want = sorted(itertools.product(range(v), range(m)))
        assert sorted(fwd) == want and sorted(bwd) == want
        for item in want:  # a backward comes after its forward
            assert steps.index(("F", *item)) < steps.index(("B", *item))
    for train in (True, False):
        schedules = build_schedules(p, m, v, train)
        rounds = plan_rounds(schedules, v)
        for r in range(p):  # each rank runs its own steps in its own order
            assert [x.step for x in rounds[r] if x.step] == schedules[r]
        nccl_matching([_batches(rounds[r], r, p, v) for r in range(p)])
    if v == 1:  # 1F1B bound: rank r holds at most p - r micro-batches (GPipe: m)
        assert live_peaks(plan_rounds(build_schedules(p, m, v), v)) == [
            min(p - r, m) for r in range(p)]


def _steady_pairs(p, r, m, v):
    """Backwards of rank ``r``'s steady state that a forward follows: all its steady-state
    (forward, backward) couples but the last, after ``w`` warm-up forwards (1F1B:
    ``p - 1 - r``; interleaved 1F1B: ``2 (p - 1 - r) + (v - 1) p``, all of them at m = p)."""
    total = m * v
    if v == 1:
        w = min(p - 1 - r, m)
    else:
        w = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
    return max(total - w - 1, 0)


PAIR_CASES = [(p, v, m) for p, v, m in itertools.product([2, 3, 4], [1, 2],
                                                        [1, 2, 3, 4, 6, 8, 12])
              if v == 1 or m % p == 0]


@pytest.mark.parametrize("p, v, m", PAIR_CASES)
def test_paired_plan_matches_by_order_and_cannot_deadlock(p, v, m):
    """With each backward paired with the next forward (the MoE all-to-all overlap) a
    pair is one round: it waits for both inputs, sends both outputs (on one channel at
    pp 2 and on the interleaved wrap-around: the activation first, as the peer receives),
    every posted send meets the peer's receive of the same message in order, NCCL-style,
    and every steady-state backward but the last pairs on every stage."""
    schedules = build_schedules(p, m, v)
    pairs = pairs_of(schedules, v)
    rounds = plan_rounds(schedules, v, pairs=pairs)
    for r in range(p):
        ran = [s for x in rounds[r] for s in (x.step, x.pair) if s]
        assert ran == schedules[r]
        units = [(x.step, x.pair) for x in rounds[r] if x.pair]
        assert units == [(schedules[r][i], schedules[r][i + 1]) for i in pairs[r]]
        assert all(b[0] == "B" and f[0] == "F" for b, f in units)
        assert len(units) == _steady_pairs(p, r, m, v)
    nccl_matching([_batches(rounds[r], r, p, v) for r in range(p)])
    # without pairs the plan is the one every other test pins
    assert plan_rounds(schedules, v, pairs=tuple(() for _ in range(p))) == plan_rounds(
        schedules, v)


@pytest.mark.parametrize("v, m", [(1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (2, 4), (2, 6),
                                  (2, 8)])
def test_every_steady_state_backward_pairs_at_pp2(v, m):
    """pp 2: 1F1B pairs m - 2 backwards on stage 0 and m - 1 on stage 1 (every backward
    a forward follows); interleaved 1F1B at vpp 2, 2m - 5 and 2m - 3. (Pairing only where
    the forward's input had arrived before the backward's round gave stage 1 one pair in
    1F1B, the warm-up one, and stage 0 m - 3 instead of 2m - 5 at vpp 2.)"""
    schedules = build_schedules(2, m, v)
    rounds = plan_rounds(schedules, v, pairs=pairs_of(schedules, v))
    want = [m - 2, m - 1] if v == 1 else [2 * m - 5, 2 * m - 3]
    assert [sum(x.pair is not None for x in rr) for rr in rounds] == want
    assert want == [_steady_pairs(2, r, m, v) for r in range(2)]


def test_pairs_refused_where_they_do_not_apply():
    schedules = build_schedules(2, 4)
    with pytest.raises(ValueError, match="not a backward followed by a forward"):
        plan_rounds(schedules, 1, pairs=((0,), ()))
    assert pairs_of(build_schedules(2, 4, schedule="zb_h1"), 1) == ((), ())


def test_unbatched_transfers_deadlock_under_nccl_semantics():
    """What the plan is for: posting each step's receive alone before it and its send
    alone after it (as megalite did with tags) deadlocks once sends block -- in 1F1B's
    steady state both neighbours send first."""
    p, m = 2, 4
    batches = []
    for r, rank_rounds in enumerate(plan_rounds(build_schedules(p, m), 1)):
        ops = []
        for rnd in rank_rounds:
            if rnd.step is None:
                continue
            kind, _, k = rnd.step
            if kind == "F" and r > 0:
                ops.append([("recv", r - 1, ("F", r - 1, k))])
            if kind == "B" and r < p - 1:
                ops.append([("recv", r + 1, ("B", r + 1, k))])
            if rnd.sends:
                ops.append([("send", r + (1 if kind == "F" else -1), (kind, r, k))])
        batches.append(ops)
    with pytest.raises(AssertionError, match="deadlock"):
        nccl_matching(batches)
    nccl_matching([_batches(rr, r, p, 1) for r, rr in enumerate(
        plan_rounds(build_schedules(p, m), 1))])


def test_plan_of_two_stages_shares_one_pair():
    """pp 2 x vpp 2: rank 0 sends activations and gradients to rank 1 on one channel; the
    plan posts them as rank 1 receives them, one message per round."""
    rounds = plan_rounds(build_schedules(2, 4, 2), 2)
    sent = [(x.step[0], x.step[1], x.step[2]) for x in rounds[0] if x.sends]
    received = [s for x in rounds[1] for s in x.recvs]
    assert {k for k, _, _ in sent} == {"F", "B"}
    # rank 0's chunk c output feeds rank 1's chunk c (F) / chunk c - 1 (B), same mb
    assert [(k, c if k == "F" else c - 1, mb) for k, c, mb in sent] == received


def test_stuck_step_lists_raise():
    with pytest.raises(ScheduleError, match="stuck"):
        plan_rounds([[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]], 1)


def test_one_f_one_b_shape():
    assert one_f_one_b(1, 0, 3) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1),
                                    ("F", 0, 2), ("B", 0, 2)]
    assert one_f_one_b(4, 0, 4)[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3)]


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(ConfigError, match=r"micro-batches \(6\) to be a multiple of "
                                          r"pipeline_model_parallel_size \(4\)"):
        interleaved_one_f_one_b(4, 0, 6, 2)


def test_layer_layout():
    assert layers_per_stage(8, 4) == [2, 2, 2, 2]
    assert layers_per_stage(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert chunk_layer_ranges(8, 2, 2) == [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]
    assert chunk_layer_ranges(6, 3, None, first=1, last=1) == [[(0, 1)], [(1, 4)], [(5, 1)]]
    with pytest.raises(ConfigError, match="cannot split 7 layers over 4"):
        layers_per_stage(7, 4, first=2)
    with pytest.raises(ConfigError, match="not divisible by the 2 virtual"):
        chunk_layer_ranges(6, 2, 2)


# -- real execution against a single-process reference -----------------------------------
H, S, B = 8, 4, 2


def _layer(i):
    g = torch.Generator().manual_seed(1000 + i)
    lin = torch.nn.Linear(H, H)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(H, H, generator=g) * 0.5)
        lin.bias.copy_(torch.randn(H, generator=g) * 0.1)
    return lin


def _batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _reference(num_layers, m):
    layers = [_layer(i) for i in range(num_layers)]
    total = 0.0
    for k in range(m):
        x, target = _batch(k)
        for lin in layers:
            x = torch.tanh(lin(x))
        loss = ((x - target) ** 2).mean() / m
        loss.backward()
        total += loss.item()
    return total, {i: lin.weight.grad.clone() for i, lin in enumerate(layers)}


def _pipeline_body(rank, world_size, cases, wait_sends, pair=False):
    if wait_sends:  # NCCL's semantics: a batch of transfers completes as a whole
        os.environ[WAIT_SENDS_ENV] = "1"
    out = []
    for num_layers, v, m, first, last in cases:
        sizes = dict(pipeline_model_parallel_size=world_size)
        if v > 1:
            sizes["virtual_pipeline_model_parallel_size"] = v
        with parallel_state(**sizes) as ps:
            r = ps.pp.rank
            ranges = chunk_layer_ranges(num_layers, world_size, v, first, last)[r]
            chunks = [[(i, _layer(i)) for i in range(a, a + n)] for a, n in ranges]
            losses = []

            def forward_step(chunk, mb, x):
                inp, target = _batch(mb)
                h = inp if x is None else x
                for _, lin in chunks[chunk]:
                    h = torch.tanh(lin(h))
                if ps.is_pipeline_last_stage(chunk if v > 1 else None) and (
                        chunk == v - 1):
                    loss = ((h - target) ** 2).mean() / m
                    losses.append(loss.item())
                    return loss
                return h

            comm = PipeComm(ps, (S, B, H), torch.float32)
            stats = ScheduleStats()
            run_schedule(build_schedules(world_size, m, v), forward_step=forward_step,
                         ps=ps, vpp=v, comm=comm, stats=stats, pair_backward_forward=pair)
            grads = {i: lin.weight.grad.clone() for ch in chunks for i, lin in ch}
            out.append((sum(losses), grads, stats.peak_live_outputs, stats.pairs))
    return out


def _check(world, cases, wait_sends=False, pair=False):
    results = run_distributed(world, _pipeline_body, cases, wait_sends, pair)
    for n, (num_layers, v, m, first, last) in enumerate(cases):
        ref_loss, ref_grads = _reference(num_layers, m)
        assert abs(results[-1][n][0] - ref_loss) < 1e-6
        got = {}
        for rank_result in results:
            got.update(rank_result[n][1])
        assert sorted(got) == sorted(ref_grads)
        for i in ref_grads:
            torch.testing.assert_close(got[i], ref_grads[i], rtol=1e-5, atol=1e-6)
        if v == 1:
            assert [r[n][2] for r in results] == [min(world - k, m) for k in range(world)]
        assert [r[n][3] for r in results] == [
            _steady_pairs(world, k, m, v) if pair else 0 for k in range(world)]


@pytest.mark.parametrize("wait_sends", [False, True], ids=["async-sends", "wait-sends"])
def test_pipeline_matches_single_process_pp2(wait_sends):
    _check(2, [(4, 1, 4, None, None), (4, 2, 4, None, None), (6, 1, 3, 2, None),
               (8, 2, 2, None, None), (4, 1, 1, None, None)], wait_sends)


@pytest.mark.parametrize("wait_sends", [False, True], ids=["async-sends", "wait-sends"])
def test_paired_pipeline_matches_single_process_pp2(wait_sends):
    """Each backward paired with the next forward (no all-to-all here: the lanes run one
    after the other) through real transfers: a pair's activation and gradient go to the
    one peer in one batch (at vpp 2 on rank 0 too: the wrap-around)."""
    _check(2, [(4, 1, 4, None, None), (4, 2, 4, None, None), (8, 2, 6, None, None)],
           wait_sends, pair=True)


@pytest.mark.parametrize("wait_sends", [False, True], ids=["async-sends", "wait-sends"])
def test_pipeline_matches_single_process_pp4(wait_sends):
    _check(4, [(8, 1, 8, None, None), (8, 2, 8, None, None), (8, 2, 4, None, None),
               (7, 1, 4, 1, 2), (4, 1, 2, None, None)], wait_sends)
