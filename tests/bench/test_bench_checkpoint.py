"""tools/benchmark.py checkpoint on a tiny model: the whole throughput path runs (saves
with and without checksums, loads from the page cache and from disk, verified and not,
raw torch.save/load, async), and each row reports a time it measured."""

import re

from tools.bench import checkpoint as bench


def test_checkpoint_benchmark_rows(tmp_path, capsys):
    bench.main(["--size-mb", "2", "--repeat", "2", "--load-pairs", "1", "--disk-pairs", "1",
                "--no-stall", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(\S.*?)\s{2,}([0-9.]+)\s+[0-9.]+\s+\d+$", out, re.M))
    for name in ("megalite save (", "megalite load (", "megalite load from disk (",
                 "torch.save", "torch.load", "megalite async: total"):
        assert sum(k.startswith(name) for k in rows) == (2 if "megalite" in name and
                                                         "async" not in name else 1), out
    assert float(rows["torch.save (fsync)"]) > 0      # an fsynced write takes time
    for what in ("save", "load", "load from disk"):
        assert re.search(rf"checksum overhead on {what}: [+-]\d+\.\d% \(medians\)", out), out
    assert not list(tmp_path.iterdir())      # its temporary directory is removed
