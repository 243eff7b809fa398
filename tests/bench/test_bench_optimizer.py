"""tools/benchmark.py optimizer on a tiny model: a row per optimizer, whose state bytes per
parameter are the algorithms' (AdamW 8, SGD 4, Muon and Lion 4 on the matrices and 8
elsewhere) and
whose Newton-Schulz FLOPs are counted for Muon only; and the communication of one step at
dp 2, tp 2 and dp 2 x tp 2 (AdamW and Muon, with and without the distributed optimizer),
counted per collective, against theory: the gradient all-reduce / reduce-scatter and the
parameter all-gather of data parallelism, Muon's tp gather to owner ranks and its owner
exchange over dp, exactly (the buckets of this model need no padding), and only scalars
besides; with --fp8-param-gather (bf16, tensorwise fp8 linears) the parameter all-gather
sends the fp8 linears' weights at one byte per element, half of bf16's, plus one amax
scalar per fp8 weight over dp and tp."""

import pytest

from tools.bench import optimizer as bench


def test_rows(capsys, pooled_ranks):
    rows = bench.main(["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                       "--vocab-size", "256", "--repeat", "1",
                       "--comm-layouts", "2x1", "1x2", "2x2"])
    comm = rows.pop("comm")
    steps = comm.pop("step_s")
    assert set(steps) == set(comm) and all(sec > 0 for sec in steps.values())
    assert list(rows) == ["adam", "sgd", "muon", "lion"]
    assert rows["adam"]["bytes"] == pytest.approx(8, rel=0.01)
    assert rows["sgd"]["bytes"] == pytest.approx(4, rel=0.01)
    frac = rows["muon"]["matrices"]
    assert 0.3 < frac < 1
    assert rows["muon"]["bytes"] == pytest.approx(4 * frac + 8 * (1 - frac), rel=0.01)
    # Lion: one state tensor for the linear weights (here Muon's matrices), AdamW's two else
    assert rows["lion"]["bytes"] == pytest.approx(4 * frac + 8 * (1 - frac), rel=0.01)
    assert rows["muon"]["ns_flops"] > 0 == rows["adam"]["ns_flops"]
    assert all(r["step"] > 0 for r in rows.values())
    out = capsys.readouterr().out
    assert "NS GFLOP/s" in out and "optimizer communication per step" in out
    assert "optimizer step time on gloo ranks" in out

    assert set(comm) == {(dp, tp, o, d) for dp, tp in ((2, 1), (1, 2), (2, 2))
                         for o in ("adam", "muon") for d in ((False, True) if dp > 1
                                                             else (False,))} | {
        (2, 1, "adam-fp8", True), (2, 2, "adam-fp8", True)}
    for (dp, tp, optimizer, distributed), row in comm.items():
        what = (dp, tp, optimizer, distributed)
        for kind, (got, want) in row.items():
            if kind == "other":        # the inf/nan check and the norm's scalars
                # fp8: each of the 8 fp8 weights' amax, 4 bytes over dp and 4 over tp
                limit = 64 + (8 * 8 if optimizer == "adam-fp8" else 0)
                assert got < limit and want == 0, (what, got)
            else:
                assert got == pytest.approx(want, rel=1e-9, abs=1e-9), (what, kind)
        big = {k for k, (got, _) in row.items() if got and k != "other"}
        want_kinds = set()
        if dp > 1:
            want_kinds |= ({"grad reduce-scatter", "param all-gather"} if distributed
                           else {"grad all-reduce"})
        if optimizer == "muon" and tp > 1:
            want_kinds.add("muon tp gather")
        if optimizer == "muon" and distributed:
            want_kinds.add("muon owner exchange")
        assert big == want_kinds, (what, big)
    # the distributed optimizer halves the gradient traffic and adds the same again as
    # the parameter all-gather; Muon's tp gather happens on one dp rank per matrix with it
    plain, sharded = comm[(2, 2, "muon", False)], comm[(2, 2, "muon", True)]
    assert sharded["grad reduce-scatter"][0] * 2 == plain["grad all-reduce"][0]
    assert sharded["muon tp gather"][0] * 2 == plain["muon tp gather"][0]
    # --fp8-param-gather: of bf16's 2 bytes per element (half the fp32 gather) the fp8
    # linears' weights (at tp 1 the Muon matrices' fraction of the model) send one
    bf16 = comm[(2, 1, "adam", True)]["param all-gather"][0] / 2
    fp8 = comm[(2, 1, "adam-fp8", True)]["param all-gather"][0]
    assert fp8 == pytest.approx(bf16 * (1 - frac / 2), rel=1e-9)
    bf16 = comm[(2, 2, "adam", True)]["param all-gather"][0] / 2
    assert comm[(2, 2, "adam-fp8", True)]["param all-gather"][0] < 0.6 * bf16
