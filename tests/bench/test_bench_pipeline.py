"""tools/benchmark.py pipeline on 2 gloo ranks with 2 ms stages: a row per (micro-batches,
virtual stages) with Megatron's bubble theory, a measured bubble, and 1F1B's and GPipe's
peak live micro-batches as theory says (p - rank, and m)."""

import math

from tools.bench import pipeline as bench


def test_rows_and_live_micro_batches(capsys, pooled_ranks):
    rows = bench.main(["--pipeline-model-parallel-size", "2", "--microbatches", "2", "4",
                       "--virtual-pipeline-model-parallel-size", "1", "2", "--forward-ms", "2",
                       "--seq-length", "8", "--hidden-size", "16"])
    capsys.readouterr()
    assert set(rows) == {(2, 1), (4, 1), (2, 2), (4, 2)}
    for (m, v), row in rows.items():
        assert row["theory"] == (2 - 1) / (v * m)
        assert 0 < row["bubble"] < math.inf and row["step"] > 0, (m, v)
        assert row["gpipe_live"] == [m, m]
        if v == 1:
            assert row["live"] == [2, 1], (m, v)
