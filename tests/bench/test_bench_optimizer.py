"""tools/benchmark.py optimizer on a tiny model: a row per optimizer, whose state bytes per
parameter are the algorithms' (AdamW 8, SGD 4, Muon 4 on the matrices and 8 elsewhere) and
whose Newton-Schulz FLOPs are counted for Muon only."""

import pytest

from tools.bench import optimizer as bench


def test_rows(capsys):
    rows = bench.main(["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                       "--vocab-size", "256", "--repeat", "1"])
    assert list(rows) == ["adam", "sgd", "muon"]
    assert rows["adam"]["bytes"] == pytest.approx(8, rel=0.01)
    assert rows["sgd"]["bytes"] == pytest.approx(4, rel=0.01)
    frac = rows["muon"]["matrices"]
    assert 0.3 < frac < 1
    assert rows["muon"]["bytes"] == pytest.approx(4 * frac + 8 * (1 - frac), rel=0.01)
    assert rows["muon"]["ns_flops"] > 0 == rows["adam"]["ns_flops"]
    assert all(r["step"] > 0 for r in rows.values())
    assert "NS GFLOP/s" in capsys.readouterr().out
