"""tools/benchmark.py moe on 4 tiny experts and 2 gloo ranks: both expert paths timed, and
each dispatcher's bytes against the benchmark's theory (allgather's exactly); the
fine-grained section (top-8 of 64 experts against the dense MLP) at ep 1 and 2, tiny; the
all-to-all overlap section at ep 2 and pp 2 x ep 2 (the pairs each stage ran)."""

import math

from tools.bench import moe as bench


def test_expert_paths_and_dispatcher_bytes(capsys, pooled_ranks):
    out = bench.main(["--tokens", "64", "--hidden-size", "32", "--moe-ffn-hidden-size", "64",
                      "--num-experts", "4", "--moe-router-topk", "2", "--repeat", "1",
                      "--ranks", "2", "--dispatch-tokens", "32", "--fine-ranks"])
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


def test_fine_grained_experts_against_dense(capsys, pooled_ranks):
    out = bench.main(["--skip-compute", "--ranks", "--fine-ranks", "1", "2",
                      "--fine-tokens", "32", "--fine-hidden-size", "16",
                      "--fine-ffn-hidden-size", "4", "--repeat", "1"])
    rows = out["fine_grained"]
    assert set(rows) == {1, 2}
    for row in rows.values():
        assert row["moe_tokens_per_s"] > 0 and row["dense_tokens_per_s"] > 0
        assert row["ratio"] == row["moe_tokens_per_s"] / row["dense_tokens_per_s"]
    assert rows[1]["a2a_bytes"] == rows[1]["theory"] == 0
    # 32 tokens x top-8 rows of 16 fp32 to dispatch and combine, about half leave the rank
    assert 0.5 < rows[2]["a2a_bytes"] / rows[2]["theory"] < 1.5
    assert "fine-grained experts: E=64 top-8" in capsys.readouterr().out


def test_all_to_all_overlap_measured(capsys, pooled_ranks):
    out = bench.main(["--skip-compute", "--ranks", "--fine-ranks", "--overlap-ranks", "2",
                      "--overlap-hidden-size", "16", "--overlap-tokens", "32",
                      "--overlap-microbatches", "3", "--overlap-layers", "2",
                      "--repeat", "1"])
    row = out["overlap"][2]
    plain, overlap = row["plain"], row["overlap"]
    # per step: 3 micro-batches x 2 MoE layers x (dispatch + combine) x (forward + backward)
    assert plain["calls"] == overlap["calls"] == 24
    assert plain["overlapped"] == 0
    # the 2 pairs (B0 + F1, B1 + F2) each hand over at their 8 exchanges, or all but the
    # last of a lane that outlives the other
    assert 12 <= overlap["overlapped"] <= 16
    assert 0 < plain["blocked_s"] <= plain["span_s"] and overlap["span_s"] > 0
    assert row["hidden_fraction"] == 1 - overlap["blocked_s"] / plain["blocked_s"]
    assert plain["pairs_by_stage"] == [0] and overlap["pairs_by_stage"] == [2]
    assert "all-to-all overlap" in capsys.readouterr().out


def test_shared_expert_overlap_measured(capsys, pooled_ranks):
    """--overlap-shared-expert-size adds --moe-shared-expert-overlap: each forward dispatch
    runs the shared experts while in flight, nothing pairs."""
    out = bench.main(["--skip-compute", "--ranks", "--fine-ranks", "--overlap-ranks", "2",
                      "--overlap-hidden-size", "16", "--overlap-tokens", "32",
                      "--overlap-microbatches", "3", "--overlap-layers", "2",
                      "--overlap-shared-expert-size", "32", "--repeat", "1"])
    row = out["overlap"][2]
    plain, shared = row["plain"], row["shared"]
    assert plain["calls"] == shared["calls"] == 24 and plain["overlapped"] == 0
    assert shared["overlapped"] == 3 * 2      # the forward dispatch of each layer and batch
    assert shared["pairs_by_stage"] == [0]
    assert row["shared_hidden_fraction"] == 1 - shared["blocked_s"] / plain["blocked_s"]
    assert "shared experts of width 32" in capsys.readouterr().out


def test_all_to_all_overlap_over_two_pipeline_stages(capsys, pooled_ranks):
    """pp 2 x ep 2 (4 ranks): every backward of 1F1B's steady state pairs on both stages
    (m - 2 and m - 1), each pair's exchanges overlapped."""
    out = bench.main(["--skip-compute", "--ranks", "--fine-ranks", "--overlap-ranks", "2",
                      "--overlap-pp", "2", "--overlap-hidden-size", "16",
                      "--overlap-tokens", "16", "--overlap-microbatches", "4",
                      "--overlap-layers", "1", "--repeat", "1"])
    row = out["overlap"][2]
    plain, overlap = row["plain"], row["overlap"]
    # per stage and step: 4 micro-batches x 1 MoE layer x 2 exchanges x (forward + backward)
    assert plain["calls"] == overlap["calls"] == 16 and plain["overlapped"] == 0
    assert plain["pairs_by_stage"] == [0, 0] and overlap["pairs_by_stage"] == [2, 3]
    assert overlap["overlapped"] == 3 * 4   # stage 1: 3 pairs of 2 + 2 exchanges
    assert "pairs run per pipeline stage: [2, 3]" in capsys.readouterr().out
