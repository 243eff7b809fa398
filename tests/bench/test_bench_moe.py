"""tools/benchmark.py moe on 4 tiny experts and 2 gloo ranks: both expert paths timed, and
each dispatcher's bytes against the benchmark's theory (allgather's exactly)."""

import math

from tools.bench import moe as bench


def test_expert_paths_and_dispatcher_bytes(capsys, pooled_ranks):
    out = bench.main(["--tokens", "64", "--hidden-size", "32", "--moe-ffn-hidden-size", "64",
                      "--num-experts", "4", "--moe-router-topk", "2", "--repeat", "1",
                      "--ranks", "2", "--dispatch-tokens", "32"])
    text = capsys.readouterr().out
    assert len(out["experts"]) == 4
    assert all(0 < s < math.inf for s in out["experts"].values())
    assert set(out["dispatchers"]) == {(2, "alltoall"), (2, "allgather")}
    gather, a2a = out["dispatchers"][(2, "allgather")], out["dispatchers"][(2, "alltoall")]
    assert gather["dispatch"] == gather["theory"] == 32 * 32 * 4   # T h 4 (ep - 1)
    assert 0.5 < a2a["dispatch"] / a2a["theory"] < 1.5   # random routing, not uniform
    for row in (gather, a2a):
        assert row["combine"] == row["dispatch"] and row["metadata"] > 0
    assert "grouped / loop speed-up" in text
