"""The planner's memory model against measured peaks of real CPU training runs.

Each row of ``tests/planner/cases.py`` trains one step on gloo ranks under the
profiler's allocation tracker (:func:`megalite.planner.measure.measure_training_peak`);
the estimate (:func:`megalite.planner.memory.estimate_memory`) for each rank's pipeline
stage must be within 10% of that rank's measured peak, and its parameter count exact.
"""

from __future__ import annotations

import pytest

from megalite.planner.memory import estimate_memory
from tests.layouts import run_by_world
from tests.planner.cases import MEMORY_CASES, measure_body, planner_config

TOLERANCE = 0.10
# rows not yet within 10% in every run, checked in the slow suite only:
# MoE tp2 sp ep2: its four ranks measure 5.5 to 6.2 MiB against 6.30 estimated, the
# estimate 4% to 15% over on the last rank and over 10% in 3 runs of 7 when each rank was
# checked; against the largest of the four (the busiest expert rank the estimate budgets,
# as the test now checks MoE rows) +4.1%, +5.3% and +6.6% in three runs, to be confirmed
# over more runs before the row joins the main suite;
# ZeRO-3: 8.12 to 8.83 MiB against 8.13 estimated (with gloo's staging copy of the
# prefetched unit's gather: 0% to -8%; it was over 10% on one rank before that copy was
# counted), but the 0.7 MiB spread from run to run is not yet explained
TIMING_SENSITIVE = {"mem-tp2-sp-dp2-ep2-distopt-moe", "mem-dp2-optim_grads_params-zero3"}
CASES = [pytest.param(c, marks=pytest.mark.slow) if c.name in TIMING_SENSITIVE else c
         for c in MEMORY_CASES]


@pytest.fixture(scope="module")
def measured():
    return run_by_world(MEMORY_CASES, measure_body)


def test_cases_cover_dense_moe_optimizers_recompute_and_pipelines():
    """At least 12 layouts, dense and MoE, with and without the distributed optimizer,
    recompute and pipeline schedules."""
    assert len({c.name for c in MEMORY_CASES} - TIMING_SENSITIVE) >= 12
    assert any("num_experts" in c.model for c in MEMORY_CASES)
    assert any(c.parallel.get("use_distributed_optimizer") for c in MEMORY_CASES)
    assert {c.model.get("recompute_granularity") for c in MEMORY_CASES} >= {
        "full", "selective", None}
    assert any(c.parallel.get("virtual_pipeline_model_parallel_size") for c in MEMORY_CASES)


@pytest.mark.parametrize("lay", CASES, ids=str)
def test_memory_estimate_matches_measured_peak(lay, measured):
    """Each rank's peak within TOLERANCE of the estimate of its pipeline stage. With MoE
    layers the estimate budgets the busiest expert rank (``MOE_IMBALANCE`` of the even
    share of routed tokens), so it must match the largest peak of the stage's ranks and
    may exceed the others' (an expert rank whose experts drew fewer tokens: 9.5 against
    10.7 MiB at dp2 ep2 in one CI run)."""
    cfg = planner_config(lay)
    moe = bool(lay.model.get("num_experts"))
    lines, peaks, estimates = [], {}, {}
    for rank, got in enumerate(measured(lay)):
        est = estimate_memory(cfg, lay.world_size, got["pp_rank"], device_type="cpu")
        assert est.params_elements == got["params"], (rank, est.params_elements, got)
        lines.append(f"rank {rank}: measured {got['peak'] / 2**20:.3f} MiB, estimated "
                     f"{est.total / 2**20:.3f} MiB ({est.total / got['peak'] - 1:+.1%})")
        peaks.setdefault(got["pp_rank"], []).append(got["peak"])
        estimates[got["pp_rank"]] = est.total
    bad = []
    for stage, stage_peaks in peaks.items():
        checked = [max(stage_peaks)] if moe else stage_peaks
        bad += [peak for peak in checked if abs(estimates[stage] / peak - 1) > TOLERANCE]
        bad += [peak for peak in stage_peaks if peak > estimates[stage] * (1 + TOLERANCE)]
    assert not bad, f"{lay}: estimate off by more than {TOLERANCE:.0%}:\n" + "\n".join(lines)
