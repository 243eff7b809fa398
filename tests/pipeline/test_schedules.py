"""Pipeline schedules: step lists are complete and deadlock-free; gradients match."""

import itertools

import pytest
import torch

from megalite.config import ConfigError
from megalite.pipeline.layout import chunk_layer_ranges, layers_per_stage
from megalite.pipeline.p2p import PipeComm
from megalite.pipeline.schedules import (
    ScheduleStats,
    build_schedule,
    interleaved_one_f_one_b,
    one_f_one_b,
    run_schedule,
)
from tests.distributed.harness import parallel_state, run_distributed


def simulate(p, v, m):
    """Run every rank's steps with async sends and blocking receives; return the
    peak number of in-flight micro-batches per rank, or raise on a deadlock."""
    steps = [build_schedule(p, r, m, v) for r in range(p)]
    pieces = p * v
    done = set()  # ("F"/"B", piece, mb)
    channels = {}  # (src, dst, tag) -> sends in order / receives in order
    pos = [0] * p
    live, peak = [0] * p, [0] * p
    while any(pos[r] < len(steps[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(steps[r]):
                continue
            kind, c, k = steps[r][pos[r]]
            g = c * p + r
            if kind == "F":
                need = ("F", g - 1, k) if g > 0 else None
            else:
                need = ("B", g + 1, k) if g < pieces - 1 else None
            if need is not None and need not in done:
                continue
            if need is not None:
                src = need[1] % p
                tag = kind
                channels.setdefault((src, r, tag, "recv"), []).append(need)
            if (kind == "F" and g < pieces - 1) or (kind == "B" and g > 0):
                dst = (r + 1) % p if kind == "F" else (r - 1) % p
                channels.setdefault((r, dst, kind, "send"), []).append((kind, g, k))
            done.add((kind, g, k))
            live[r] += 1 if kind == "F" else -1
            peak[r] = max(peak[r], live[r])
            pos[r] += 1
            progressed = True
        if not progressed:
            raise AssertionError(f"deadlock p={p} v={v} m={m} at {pos}")
    for (src, dst, tag, kind), msgs in channels.items():
        if kind == "recv":  # receives match sends in order on every channel
            assert msgs == channels[(src, dst, tag, "send")], (p, v, m, src, dst, tag)
    return peak


@pytest.mark.parametrize("p, v, m", [(p, v, m) for p, v, m in itertools.product(
    [1, 2, 3, 4, 8], [1, 2, 3, 4], [1, 2, 4, 8, 12, 16]) if v == 1 or (p > 1 and m % p == 0)])
def test_schedule_is_complete_and_deadlock_free(p, v, m):
    for r in range(p):
        steps = build_schedule(p, r, m, v)
        fwd = [s[1:] for s in steps if s[0] == "F"]
        bwd = [s[1:] for s in steps if s[0] == "B"]
        want = sorted(itertools.product(range(v), range(m)))
        assert sorted(fwd) == want and sorted(bwd) == want
        for item in want:  # a backward comes after its forward
            assert steps.index(("F", *item)) < steps.index(("B", *item))
    peak = simulate(p, v, m)
    if v == 1:  # 1F1B bound: rank r holds at most p - r micro-batches (GPipe: m)
        assert peak == [min(p - r, m) for r in range(p)]


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


def _pipeline_body(rank, world_size, cases):
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
            run_schedule(build_schedule(world_size, r, m, v), forward_step=forward_step,
                         ps=ps, vpp=v, comm=comm, stats=stats)
            grads = {i: lin.weight.grad.clone() for ch in chunks for i, lin in ch}
            out.append((sum(losses), grads, stats.peak_live_outputs))
    return out


def _check(world, cases):
    results = run_distributed(world, _pipeline_body, cases)
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


def test_pipeline_matches_single_process_pp2():
    _check(2, [(4, 1, 4, None, None), (4, 2, 4, None, None), (6, 1, 3, 2, None),
               (8, 2, 2, None, None), (4, 1, 1, None, None)])


def test_pipeline_matches_single_process_pp4():
    _check(4, [(8, 1, 8, None, None), (8, 2, 8, None, None), (8, 2, 4, None, None),
               (7, 1, 4, 1, 2), (4, 1, 2, None, None)])
