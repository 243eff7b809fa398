"""Progress bars of long work (index building, checkpoint conversion, evaluation) are
tqdm bars on stderr, off when stderr is not a terminal; they change no result."""

import io
import sys

import numpy as np

from megalite.data.gpt_dataset import index_progress
from megalite.data.indices import build_gpt_indices
from tests.tools import load_tool


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_index_building_reports_each_index():
    lengths = np.array([5, 9, 3, 12, 7, 4, 8], dtype=np.int32)
    docs = np.arange(7, dtype=np.int32)
    seen = []
    with_bar = build_gpt_indices(lengths, docs, 6, 20, 1234, progress=seen.append)
    plain = build_gpt_indices(lengths, docs, 6, 20, 1234)
    assert seen == ["document index", "sample index", "shuffle index"]
    assert all(np.array_equal(a, b) for a, b in zip(with_bar, plain))
    assert len(plain[1]) - 1 >= 20


def test_bars_only_on_a_terminal(monkeypatch):
    convert = load_tool("convert_checkpoint")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert index_progress("train indices", 4).disable
    assert convert.progress(2, "convert", " step").disable
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = index_progress("train indices", 4)
    assert not bar.disable
    bar.close()
    with convert.progress(["a", "b"], "read safetensors", " file") as files:
        assert not files.disable and list(files) == ["a", "b"]
