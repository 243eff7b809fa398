"""ZB-V and DualPipeV (``megalite.pipeline.v_shape``): the V placement of the layers, step
lists complete and in dependency order, transfers matched by order alone (NCCL) with
chunk 1 running back up the ranks and the turn on the last rank kept local, the activation memory of
1F1B, the bubble against its theory, and the flag's bad inputs. The training equivalence is in the
``pipeline`` rows of ``tests/layouts.py`` (``-zbv``)."""

import itertools

import pytest

from megalite.config import ConfigError
from megalite.config.layout import chunk_layer_ranges
from megalite.parallel.state import rank_groups
from megalite.pipeline.plan import piece_of, place, plan_rounds
from megalite.pipeline.schedules import build_schedules
from megalite.pipeline.zero_bubble import simulate
from tests.pipeline.test_pipeline_schedules import nccl_matching
from tests.pipeline.test_zero_bubble import _in_flight   # (chunk, micro-batch) pairs here
from tests.training.common import tiny_config

ZBV_CASES = [("zbv", p, m) for p, m in itertools.product([2, 3, 4, 8], [1, 2, 3, 4, 8, 12, 16])]
ZBV_CASES += [("dualpipev", p, m) for p, m in itertools.product([2, 3, 4, 8], [4, 8, 9, 16])
              if m >= 2 * p]


def _v_batches(rounds, r, p):
    """Rank ``r``'s point-to-point batches under the V placement: each op is
    ("send" | "recv", peer, message), a message named by its sending piece and micro-batch.
    The peers are derived here from the pieces, independently of the plan's fields, and
    checked against them."""
    out = []
    for rnd in rounds:
        ops = []
        if rnd.sends:
            kind, c, k = rnd.step
            piece = piece_of(r, c, p, True)
            dest, _ = place(piece + (1 if kind == "F" else -1), p, True)
            assert dest == rnd.send_to != r
            ops.append(("send", dest, (kind, piece, k)))
        assert len(rnd.recv_from) == len(rnd.recvs)
        for (kind, c, k), src in zip(rnd.recvs, rnd.recv_from):
            src_piece = piece_of(r, c, p, True) + (-1 if kind == "F" else 1)
            assert place(src_piece, p, True)[0] == src != r
            ops.append(("recv", src, (kind, src_piece, k)))
        if ops:
            out.append(ops)
    return out


def test_v_placement_of_the_layers():
    """Rank r holds piece r and piece 2p - 1 - r: rank 0 the first and the last layers."""
    assert chunk_layer_ranges(8, 2, 2, v_shape=True) == [[(0, 2), (6, 2)], [(2, 2), (4, 2)]]
    assert chunk_layer_ranges(8, 4, 2, v_shape=True) == [
        [(0, 1), (7, 1)], [(1, 1), (6, 1)], [(2, 1), (5, 1)], [(3, 1), (4, 1)]]
    for p in (2, 3, 4):
        for piece in range(2 * p):
            assert piece_of(*place(piece, p, True), p, True) == piece
    # the tied embedding's group: the first stage alone (it holds both copies)
    assert rank_groups(4, pp=2, v_shape=True)["embedding"] == [[0], [1]]
    assert rank_groups(4, pp=2)["embedding"] == [[0, 2], [1, 3]]


@pytest.mark.parametrize("schedule, p, m", ZBV_CASES)
def test_v_schedules_are_complete_ordered_and_nccl_matched(schedule, p, m):
    schedules = build_schedules(p, m, 2, schedule=schedule)
    for steps in schedules:
        for kind, c in itertools.product("FBW", range(2)):
            # each chunk's micro-batches enter in order
            assert [s[2] for s in steps if s[:2] == (kind, c)] == (
                list(range(m)) if kind != "W" else sorted(s[2] for s in steps
                                                          if s[:2] == (kind, c)))
            assert sorted(s[2] for s in steps if s[:2] == (kind, c)) == list(range(m))
        for c, mb in itertools.product(range(2), range(m)):
            assert steps.index(("F", c, mb)) < steps.index(("B", c, mb)) \
                < steps.index(("W", c, mb))
        # 1F1B's activation memory: 2p half-stage chunks, p stages' worth (DualPipeV:
        # one chunk more, its main phase's forward before the paired backward)
        assert _in_flight(steps) <= 2 * min(p, m) + (schedule == "dualpipev")
    for train in (True, False):
        lists = build_schedules(p, m, 2, train, schedule=schedule)
        rounds = plan_rounds(lists, 2, v_shape=True)
        for r in range(p):
            assert [x.step for x in rounds[r] if x.step] == lists[r]
            assert not any(x.sends or x.local for x in rounds[r] if x.step and x.step[0] == "W")
            # the turn of the V: only the last rank keeps an output for itself
            local = {x.step for x in rounds[r] if x.local}
            assert local == ({s for s in lists[r] if s[:2] in (("F", 0), ("B", 1))}
                             if r == p - 1 else set())
        nccl_matching([_v_batches(rounds[r], r, p) for r in range(p)])


@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (3, 4), (4, 4), (4, 8), (4, 16), (8, 8),
                                  (8, 16)])
def test_zbv_bubble_against_theory(p, m):
    """Equal chunk times for F, B and W (a fused backward twice the forward): ZB-V's step
    is ``3m`` chunk slots plus one chunk forward per further stage, a bubble of
    ``(p - 1) / (6 m)`` for ``m >= p``: half ZB-H1's ``(p - 1) / (3 m)``, a third of
    interleaved 1F1B's ``(p - 1) / (2 m)`` (vpp 2, the same chunks), at 1F1B's memory."""
    total, idle = simulate(build_schedules(p, m, 2, schedule="zbv"), 2, forward=0.5,
                           backward=1.0, weight=0.5, v_shape=True)
    assert total == pytest.approx(3 * m * 0.5 * 2 + (p - 1) * 0.5)
    assert sum(idle) / p == pytest.approx((p - 1) / (6 * m))
    _, idle_zb = simulate(build_schedules(p, m, schedule="zb_h1"), forward=1, backward=2,
                          weight=1)
    assert sum(idle) / p < sum(idle_zb) / p
    if m >= 2 * p:   # DualPipeV's phases give the same step on one stream per rank
        total_dp, _ = simulate(build_schedules(p, m, 2, schedule="dualpipev"), 2,
                               forward=0.5, backward=1.0, weight=0.5, v_shape=True)
        assert total_dp == pytest.approx(total)


def _validate(world=2, model=None, train=None, **parallel):
    return tiny_config(world, model=model or {"num_layers": 8}, parallel=parallel,
                       train=train or {})


def test_zbv_derives_two_chunks_per_rank():
    cfg = _validate(pipeline_model_parallel_size=2, pipeline_schedule="zbv")
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    layout = cfg.resolve(2)
    assert layout.v_shape and layout.vpp == 2
    assert layout.stage_chunks == (((0, 2), (6, 2)), ((2, 2), (4, 2)))
    # the same given explicitly, either way
    for extra in ({"virtual_pipeline_model_parallel_size": 2},
                  {"num_layers_per_virtual_pipeline_stage": 2}):
        assert _validate(pipeline_model_parallel_size=2, pipeline_schedule="zbv",
                         **extra).resolve(2).stage_chunks == layout.stage_chunks


@pytest.mark.parametrize("parallel, model, match", [
    ({"virtual_pipeline_model_parallel_size": 4}, None, "exactly two model chunks"),
    ({"num_layers_per_virtual_pipeline_stage": 1}, None, "exactly two model chunks"),
    ({}, {"num_layers": 6}, "divisible by 2 x pipeline_model_parallel_size"),
    ({"decoder_first_pipeline_num_layers": 3}, None, "first and the last layers"),
    ({"pipeline_schedule": "dualpipev", "virtual_pipeline_model_parallel_size": 3}, None,
     "exactly two model chunks"),
])
def test_zbv_bad_inputs_are_one_clear_error(parallel, model, match):
    kw = {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv", **parallel}
    with pytest.raises(ConfigError, match=match):
        _validate(model=model, **kw)


def test_dualpipev_needs_2p_micro_batches():
    """m = 2p runs (its main phase once per rank); fewer is one error."""
    cfg = _validate(pipeline_model_parallel_size=2, pipeline_schedule="dualpipev")
    assert cfg.resolve(2).num_microbatches == 4 and cfg.resolve(2).v_shape
    with pytest.raises(ConfigError, match="dualpipev needs at least 2 x"):
        _validate(train={"global_batch_size": 6}, pipeline_model_parallel_size=2,
                  pipeline_schedule="dualpipev")


def test_zbv_needs_several_pipeline_ranks():
    with pytest.raises(ConfigError, match="pipeline-model-parallel-size > 1"):
        _validate(world=1, pipeline_schedule="zbv")


def test_dualpipev_phases():
    """DualPipeV's eight phases on rank r of p: 2(p-r-1) chunk-0 forwards first, the main
    phase F0 B1 F1 B0 with each backward's W right after it, the zero-bubble W steps
    last."""
    p, m = 4, 8
    steps = build_schedules(p, m, 2, schedule="dualpipev")
    assert steps[0][:8] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3), ("F", 0, 4),
                            ("F", 0, 5), ("F", 0, 6), ("F", 1, 0)]
    assert steps[3][:2] == [("F", 0, 0), ("F", 1, 0)]   # the last rank: no chunk-0 warm-up
    # rank 0's main phase (m - 2p + 1 = 1 round): F0 B1 W1 F1 B0 W0
    main = steps[0].index(("F", 0, 7))
    assert steps[0][main:main + 6] == [("F", 0, 7), ("B", 1, 3), ("W", 1, 3), ("F", 1, 4),
                                       ("B", 0, 0), ("W", 0, 0)]
    assert all(s[0] == "W" for s in steps[0][-1:]) and steps[3][-4:] == [
        ("W", 1, 6), ("W", 0, 6), ("W", 1, 7), ("W", 0, 7)]


def test_inference_refuses_the_v_placement(tmp_path):
    """Inference stages hold one chunk each: a V schedule there is one clear error."""
    from megalite.config import ParallelConfig
    from megalite.inference.loading import load_model
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(pipeline_schedule="zbv"))
    assert ps.v_shape and ps.num_model_chunks == 2
    with pytest.raises(ConfigError, match="training schedules"):
        load_model(str(tmp_path), ps=ps)
