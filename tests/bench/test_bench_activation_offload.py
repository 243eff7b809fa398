"""tools/benchmark.py activation-offload on 3 tiny layers: a row per number of offloaded
layers, whose resident bytes follow the benchmark's formula and whose offloaded bytes are
that many layers' worth."""

import math

import pytest

from tools.bench import activation_offload as bench


def test_rows_follow_the_formula(capsys):
    rows = bench.main(["--num-layers", "3", "--hidden-size", "64", "--seq-length", "32",
                       "--micro-batch-size", "1", "--vocab-size", "128", "--steps", "1"])
    out = capsys.readouterr().out
    assert sorted(rows) == [0, 1, 2]
    layer = rows[0]["layer_bytes"]
    assert layer > 0
    for n, row in rows.items():
        assert row["resident"] == pytest.approx(rows[0]["resident"] - n * layer, rel=0.01)
        assert row["offloaded"] == pytest.approx(n * layer, rel=0.01, abs=1)
        assert 0 < row["step"] < math.inf
    assert rows[2]["resident"] < rows[1]["resident"] < rows[0]["resident"]
    assert "planner's estimate" in out and "resident/formula" in out
