"""tools/benchmark.py data on the bundled corpus once and 10^5 synthetic tokens: every
section reports positive rates, and the vectorized sample index equals the loop's."""

import re

from tools.bench import data as bench


def test_sections_report_rates(capsys):
    bench.main(["--tokens", "1e5", "--seq-length", "64", "--blend-samples", "1000",
                "--repeat", "1", "--copies", "1"])
    out = capsys.readouterr().out
    workers = {int(m[0]): (float(m[1]), float(m[2])) for m in re.findall(
        r"^\s+(\d)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)\s+([0-9.]+)x$", out, re.M)}
    assert set(workers) == {1, 2}, out
    assert workers[1][1] == 1.0 and all(tokens > 0 and x > 0 for tokens, x in workers.values())
    assert "arrays identical: True" in out
    blends = re.findall(r"^\s+([23]) datasets: [0-9.]+s \(([0-9.]+)M samples/s\)", out, re.M)
    assert [n for n, _ in blends] == ["2", "3"], out
    reads = re.search(r"reading 2000 samples of 64 tokens .*: (\d+) samples/s", out)
    assert reads and int(reads[1]) > 0, out
