"""Progress of long work (index building, checkpoint conversion, evaluation, the server's
start, the planner's search) on stderr: a tqdm bar on a terminal, a few plain lines where
stderr is a file or a pipe (a SLURM log); it changes no result."""

import io
import os
import re
import subprocess
import sys

import numpy as np

from megalite.data.gpt_dataset import index_progress
from megalite.data.indices import build_gpt_indices
from megalite.progress import Progress
from tests.planner.test_plan_layout import SMALL
from tests.tools import REPO, load_tool


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


def test_a_bar_on_a_terminal_and_lines_in_a_log(monkeypatch):
    convert = load_tool("convert_checkpoint")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert index_progress("train indices", 4).bar is None     # plain lines
    assert convert.progress(2, "convert", "step").bar is None
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = index_progress("train indices", 4)
    assert bar.bar is not None
    bar.close()
    with convert.progress(["a", "b"], "read safetensors", "file") as files:
        assert files.bar is not None and list(files) == ["a", "b"]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_plain_lines_every_ten_percent_and_at_the_end():
    out = io.StringIO()
    with Progress(100, "evaluate", "micro-batch", stream=out, delay=0, interval=3600) as bar:
        for _ in range(100):
            bar.update(1)
    lines = _lines(out.getvalue())
    assert [line.split("(")[0] for line in lines] == \
        ["evaluate: 1% "] + [f"evaluate: {p}% " for p in range(10, 101, 10)]
    assert re.fullmatch(r"evaluate: 100% \(100/100 micro-batches, \d+ s\)", lines[-1])
    # past the interval a line is due by time, and an activity names what is going on
    out = io.StringIO()
    bar = Progress(1000, "plan", "layout", stream=out, delay=0, interval=0)
    bar.update(1)
    bar.set_postfix_str("ranking")
    bar.update(1)
    bar.close()
    assert _lines(out.getvalue()) == [
        "plan: 0% (1/1000 layouts, 0 s)", "plan: 0% (1/1000 layouts, 0 s), ranking",
        "plan: 0% (2/1000 layouts, 0 s)"]


def test_quick_or_disabled_work_prints_nothing():
    out = io.StringIO()
    with Progress(10, "convert", stream=out, delay=60) as bar:   # done within the delay
        bar.update(10)
    with Progress(10, "convert", stream=out, delay=0, disable=True) as bar:
        bar.update(10)
    assert out.getvalue() == ""
    with Progress(None, "count", "doc", stream=out, delay=0, interval=3600) as bar:
        bar.update(3)      # no total: the count alone, then the last count at the end
        bar.update(4)
    assert _lines(out.getvalue()) == ["count: (3 docs, 0 s)", "count: (7 docs, 0 s)"]


def _run(tool: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGALITE_PROGRESS_DELAY": "0", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=600)


def test_conversion_and_planner_write_progress_lines_to_a_piped_stderr(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    src = str(tmp_path / "hf")
    GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2,
                               n_head=4, bos_token_id=0, eos_token_id=0)).save_pretrained(src)
    done = _run("convert_checkpoint", ["--source", "hf", "--target", "megalite",
                                       "--load-dir", src, "--save-dir", str(tmp_path / "m")])
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    lines = [line for line in _lines(done.stderr) if line.startswith(("read ", "convert"))]
    assert "read safetensors: 100% (1/1 files, " in lines[0]
    assert [line.split(" (")[0] for line in lines[1:]] == ["convert: 50%", "convert: 100%"]

    done = _run("plan_layout", ["--preset", "a100", "--nodes", "2", "--top", "1", "--",
                                *SMALL])
    assert done.returncode == 0, done.stderr
    lines = [line for line in _lines(done.stderr) if line.startswith("plan: ")]
    total = int(re.search(r"/(\d+) layouts", lines[0]).group(1))
    assert total > 100 and 3 <= len(lines) <= 12, lines       # not one line per layout
    assert lines[-1].startswith(f"plan: 100% ({total}/{total} layouts, ")
