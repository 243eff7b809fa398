"""Start-up checks: unwritable output locations stop the run before any
work with one error naming the flag and the path; too little disk space is a warning."""

from __future__ import annotations

import os
import shutil
from collections import namedtuple

import pytest

from megalite.training.preflight import StartupError, checkpoint_bytes
from tests.training.common import ENTRYPOINT, run_training, tiny_config, tiny_flags


@pytest.fixture
def blocked(tmp_path):
    """A path whose directory cannot be created: it lies under a regular file."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    return str(blocker / "sub")


@pytest.mark.parametrize("section,key,flag,suffix", [
    ("checkpoint", "save", "--save", ""),
    ("logging", "tensorboard_dir", "--tensorboard-dir", ""),
    ("logging", "metrics_jsonl", "--metrics-jsonl", "/m.jsonl"),
])
def test_unwritable_output_stops_before_any_work(blocked, monkeypatch, section, key, flag,
                                                 suffix):
    import megalite.training.build as build

    def no_data(*a, **k):
        raise AssertionError("the datasets were built before the check")

    monkeypatch.setattr(build, "default_datasets_provider", no_data)
    cfg = tiny_config(**{section: {key: blocked + suffix}})
    with pytest.raises(StartupError) as e:
        run_training(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{flag} {blocked + suffix}: cannot create or write")
    assert "Not a directory" in msg and "writable location" in msg


def test_entrypoint_reports_one_line_and_exit_code_2(blocked):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, ENTRYPOINT, *tiny_flags(**{"--save": blocked})],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"megalite: error (rank 0): --save {blocked}: cannot create or write" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_low_disk_space_is_a_warning_naming_the_shortfall(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    save = str(tmp_path / "ckpt")
    result, c = run_training(tiny_config(train={"train_iters": 1},
                                         checkpoint={"save": save}))
    assert result.iteration == 1  # trained and saved anyway
    out = capsys.readouterr().out
    need = checkpoint_bytes(c.cfg, c.model, c.ps)
    assert need > 1000
    assert f"megalite: warning: --save {save}: 0.00 GiB free, but one checkpoint" in out
    assert "GiB short" in out
    assert os.path.isdir(save)


def test_checkpoint_estimate_counts_optimizer_state():
    from megalite.parallel.state import ParallelState
    from megalite.training.build import default_model_provider

    cfg = tiny_config()
    ps = ParallelState.build(cfg.parallel)
    try:
        model = default_model_provider(cfg, ps)
        n = sum(p.numel() for p in model.parameters())
        assert checkpoint_bytes(cfg, model, ps) == n * (4 + 8)  # fp32 + Adam's two moments
        cfg.checkpoint.no_save_optim = True
        assert checkpoint_bytes(cfg, model, ps) == n * 4
    finally:
        ps.destroy()
