"""DualPipeV in the planner: the bubble megalite's step lists give, ``(p - 1) / (6 m)``
(ZB-V's; DeepSeek-V3's ``(PP/2 - 1)(F&B + B - 3W)`` without overlap is an upper bound)
and its ``PP + 1`` chunks of activations; the search tries it beside ZB-V at vpp 2 and
megalite's validation keeps it to m >= 2p and layers divisible by 2p."""

from __future__ import annotations

import pytest

from megalite.arguments import parse_args
from megalite.pipeline.schedules import build_schedules
from megalite.pipeline.zero_bubble import simulate
from megalite.planner.cluster import preset
from megalite.planner.memory import estimate_memory
from megalite.planner.schedule import (
    bubble_fraction,
    dualpipev_bubble,
    dualpipev_in_flight,
    peak_in_flight,
)
from megalite.planner.search import schedules_for, search
from megalite.planner.time import estimate_time

SMALL = ["--num-layers", "8", "--hidden-size", "768", "--num-attention-heads", "12",
         "--seq-length", "2048", "--vocab-size", "32000", "--global-batch-size", "64",
         "--bf16", "--tokenizer-type", "NullTokenizer", "--mock-data"]


@pytest.mark.parametrize("p, m, want", [
    # (p - 1) / (6 m): megalite's step lists played with free transfers
    (2, 4, 1 / 24), (2, 8, 1 / 48), (4, 8, 3 / 48), (4, 16, 3 / 96), (8, 16, 7 / 96)])
def test_bubble_is_megalites_step_lists(p, m, want):
    assert dualpipev_bubble(p, m) == pytest.approx(want)
    assert bubble_fraction(p, m, vpp=2, schedule="dualpipev") == pytest.approx(want)
    # ZB-V's, half ZB-H1's
    assert want == pytest.approx(bubble_fraction(p, m, vpp=2, schedule="zbv"))
    assert 2 * want == pytest.approx(bubble_fraction(p, m, schedule="zb_h1"))
    if m >= 2 * p:   # DualPipeV's own limit: its step lists, equal chunk times
        _, idle = simulate(build_schedules(p, m, 2, schedule="dualpipev"), 2, forward=0.5,
                           backward=1.0, weight=0.5, v_shape=True)
        assert sum(idle) / p == pytest.approx(want)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
def test_activations_are_pp_plus_one_chunks(p, m):
    """``PP + 1`` = ``2p + 1`` half-stage chunks on every rank, as the step lists walk."""
    assert dualpipev_in_flight(p) == 2 * p + 1
    assert [peak_in_flight(p, r, m, 2, "dualpipev") for r in range(p)] == [2 * p + 1] * p


def test_estimates_use_the_schedule_terms():
    cfgs = {s: parse_args(SMALL + ["--pipeline-model-parallel-size", "4",
                                   "--pipeline-schedule", s]).validate(8)
            for s in ("zbv", "dualpipev")}
    cluster = preset("h100", 1)
    t = {s: estimate_time(c, 8, cluster) for s, c in cfgs.items()}
    # 32 micro-batches (global 64, dp 2): the same path, ZB-V's bubble
    assert t["dualpipev"].bubble == pytest.approx(t["zbv"].bubble)
    assert t["dualpipev"].bubble / (t["dualpipev"].step - t["dualpipev"].bubble) \
        > dualpipev_bubble(4, 32) * 0.9
    # the last rank holds neither embedding nor output layer: only its layers' chunks,
    # 9 of them against ZB-V's 8
    mem = {s: estimate_memory(c, 8, 3) for s, c in cfgs.items()}
    assert mem["dualpipev"].in_flight == 9 and mem["zbv"].in_flight == 8
    assert mem["dualpipev"].activations == pytest.approx(mem["zbv"].activations * 9 / 8)


def test_search_ranks_it_between_zbv_and_interleaved():
    """The bubbles are (p-1)/6m (ZB-V and DualPipeV), (p-1)/2m (interleaved 1F1B, vpp 2);
    DualPipeV holds one chunk of activations more than ZB-V, so it ranks after it; the
    rest of the step is the same, with a small vocabulary (a V schedule's rank
    0 holds both vocabulary tables, whose larger gradient reduction can outweigh the
    bubble's difference)."""
    cands = search(parse_args(SMALL + ["--vocab-size", "1024"]), preset("h100", 1),
                   tp=[1], pp=[4], vpp=[2], micro_batch_sizes=(1,), strategies=("no_shard",),
                   recomputes=("none",), overlaps=(False,))
    assert [c.schedule for c in cands] == ["zbv", "dualpipev", None]
    zbv, dual, interleaved = (c.time.bubble for c in cands)
    assert (zbv, dual) == pytest.approx((interleaved / 3, interleaved / 3))
    dual = cands[1]
    assert "dualpipev" in dual.name()
    assert parse_args(SMALL + dual.launch_flags()).validate(8).parallel.pipeline_schedule \
        == "dualpipev"
    assert schedules_for(4, 2) == (None, "zbv", "dualpipev")
    assert schedules_for(4, 2, ("1f1b", "zbv")) == (None, "zbv")
    assert schedules_for(4, 4) == (None,) and schedules_for(4, 1) == ("1f1b", "zb_h1")


def _v_candidates(flags, **kw):
    return {c.schedule: c for c in search(
        parse_args(SMALL + flags), preset("h100", 1), tp=[1], pp=[4], micro_batch_sizes=(1,),
        strategies=("no_shard",), recomputes=("none",), overlaps=(False,), **kw)
        if c.schedule in ("zbv", "dualpipev")}


def test_its_constraints_exclude_it():
    # fewer than 2p micro-batches: global 8 over dp 2 is 4 < 8
    few = _v_candidates(["--global-batch-size", "8"], vpp=[2])
    assert few["zbv"].feasible
    assert not few["dualpipev"].feasible
    assert "dualpipev needs at least" in few["dualpipev"].error
    # multi-token prediction: both V schedules with RoPE, the depths counted on rank 0
    # (the output stage); learned positions stay refused (no copy of the position table)
    rope = ["--position-embedding-type", "rope"]
    mtp = _v_candidates([*rope, "--mtp-num-layers", "1"], vpp=[2])
    plain = _v_candidates(rope, vpp=[2])
    assert set(mtp) == set(plain) == {"zbv", "dualpipev"}
    for name, c in mtp.items():
        assert c.feasible, (name, c.error)
        assert c.memory.params > plain[name].memory.params, name
    learned = _v_candidates(["--mtp-num-layers", "1"], vpp=[2])
    assert learned and all("copy of the position table" in c.error for c in learned.values())
    # layers not divisible by 2p (12 over 8 chunks): no V candidate at all
    assert _v_candidates(["--num-layers", "12"], vpp=[1, 2, 4]) == {}
