"""tools/benchmark.py pipeline on 2 gloo ranks with 2 ms stages: a row per (micro-batches,
schedule) with the schedule's bubble theory, a measured bubble, and the peak live
micro-batches of each schedule and of GPipe as theory says (1F1B: p - rank; ZB-H1: p on
every rank, until the W steps; ZB-V: at most 2p half-stage chunks; GPipe: m)."""

import math

import pytest

from tools.bench import pipeline as bench


def test_rows_and_live_micro_batches(capsys, pooled_ranks):
    rows = bench.main(["--pipeline-model-parallel-size", "2", "--microbatches", "2", "4",
                       "--virtual-pipeline-model-parallel-size", "2", "--forward-ms", "2",
                       "--seq-length", "8", "--hidden-size", "16", "--repeat", "1"])
    capsys.readouterr()
    assert set(rows) == {(m, s, v) for m in (2, 4) for s, v in (
        ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))} | {
        (4, "dualpipev", 2)}   # m >= 2p only
    for (m, schedule, v), row in rows.items():
        if schedule == "zb_h1":
            assert row["theory"] == (2 - 1) / (3 * m)
            assert row["live"] == row["live_theory"] == [2, 2], m
        elif schedule == "zbv":
            assert row["theory"] == pytest.approx((2 - 1) / (6 * m))
            assert row["live"] == row["live_theory"] == [4, 4], m
        elif schedule == "dualpipev":
            assert row["theory"] == pytest.approx((2 - 1) / (6 * m))
            assert row["live"] == row["live_theory"] == [5, 5], m
        else:
            assert row["theory"] == (2 - 1) / (v * m)
        assert 0 < row["bubble"] < math.inf and row["step"] > 0, (m, schedule)
        assert row["gpipe_live"] == [m, m]
        if schedule == "1f1b":
            assert row["live"] == row["live_theory"] == [2, 1], m
