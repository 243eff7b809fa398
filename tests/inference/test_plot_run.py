"""tools/plot_run.py writes a PNG of several runs' metrics; bad runs are one-line errors."""

import json

import pytest

from tests.tools import load_tool

pytest.importorskip("matplotlib")


def _run(path, scale):
    path.mkdir()
    rows = [{"iteration": i, "lm_loss": scale * (9 - i / 10), "grad_norm": 1.0 + i, "lr": 1e-3,
             "tokens_per_sec": 1000.0, "mfu": 0.3} for i in range(1, 21)]
    rows.append({"iteration": 20, "validation_loss": 7.5, "validation_ppl": 1800.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plot_two_runs(tmp_path, capsys):
    plot = load_tool("plot_run")
    a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 0.9)
    out = tmp_path / "figs" / "run.png"
    assert plot.main([a, b, "--output", str(out)]) == 0
    # per run: train loss, valid loss, lr, grad norm, tokens/s, mfu
    assert "12 curves from 2 run(s)" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    rows = plot.read_metrics(a)
    assert len(rows) == 20 and rows[-1]["validation_loss"] == 7.5 and rows[-1]["mfu"] == 0.3


def test_bad_runs(tmp_path, capsys):
    plot = load_tool("plot_run")
    assert plot.main([str(tmp_path), "--output", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    assert plot.main([str(tmp_path), "--output", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl:1: not a JSON line" in capsys.readouterr().err
