"""tools/benchmark.py cp on a 64-token sequence, cp 1 and 2 (2 gloo ranks): a row for each
comm type whose bytes sent equal the benchmark's theory exactly, and cp 2 keeps less for
the backward per rank than cp 1."""

import math

from tools.bench import cp as bench


def test_every_comm_type_sends_its_theory(capsys):
    rows = bench.main(["--seq-length", "64", "--num-attention-heads", "2",
                       "--num-query-groups", "2", "--kv-channels", "8", "--ranks", "1", "2"])
    out = capsys.readouterr().out
    assert set(rows) == {(1, "(none)"), (2, "p2p"), (2, "allgather"), (2, "a2a")}
    for (cp, comm), (seconds, saved, peak, sent, theory) in rows.items():
        assert 0 < seconds < math.inf and 0 < peak <= saved, (cp, comm)
        if cp == 2:
            assert sent == theory > 0, comm
    assert rows[(2, "p2p")][1] < rows[(1, "(none)")][1]   # half the sequence per rank
    # p2p's ring also carries the fp32 key/value gradients: more than allgather
    assert rows[(2, "p2p")][3] > rows[(2, "allgather")][3]
    assert "cp 2: fastest" in out and "bytes crossover" in out
