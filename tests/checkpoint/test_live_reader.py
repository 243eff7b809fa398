"""Reading a checkpoint directory that a live job saves to: readers take no
lock and read only published iterations. A directory re-saved while it is read is read
again, never half old and half new; the tools read the last complete iteration beside a
live job's lock and its half-written save."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from megalite.checkpoint import load as ckpt_load
from megalite.checkpoint import LoadOptions, load_checkpoint, save_checkpoint
from megalite.checkpoint.consolidated import single_process_state
from megalite.checkpoint.files import CheckpointError, iteration_dir
from megalite.checkpoint.lock import LOCK
from megalite.models.gpt import GPTModel
from tests.tools import load_tool
from tests.training.common import REPO, only_iteration, run_training, tiny_config

WRITER = """
import sys, torch
from megalite.checkpoint import save_checkpoint
from megalite.checkpoint.consolidated import single_process_state
from megalite.checkpoint.lock import SaveLock
from megalite.models.gpt import GPTModel
from tests.training.common import tiny_config
root, iteration, value = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cfg, ps = tiny_config(), single_process_state()
model = GPTModel(cfg.model, ps, seed=1)
with torch.no_grad():
    for p in model.parameters():
        p.fill_(value)
lock = SaveLock.acquire(root)
save_checkpoint(root, iteration, model, None, None, ps, cfg.to_dict(), int(value),
                save_optim=False, save_rng=False)
lock.release()
"""


def write_in_another_process(root: str, iteration: int, value: float) -> None:
    """Another job (process) saves ``iteration`` under ``root``: every weight ``value``."""
    subprocess.run([sys.executable, "-c", WRITER, root, str(iteration), str(value)],
                   check=True, cwd=REPO, timeout=300,
                   env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))


def filled(value: float):
    cfg, ps = tiny_config(), single_process_state()
    model = GPTModel(cfg.model, ps, seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return cfg, ps, model


def weight_values(model) -> set[float]:
    return {v for p in model.parameters() for v in p.detach().unique().tolist()}


def test_a_directory_resaved_during_the_read_is_read_again(tmp_path, monkeypatch, capsys):
    """Rank 0 has chosen iteration 3 and read its metadata; before a byte of data is read
    another process re-saves iteration 3 with other weights. The load notices, reads the
    new directory whole: every weight and the consumed samples are the new save's (read
    through the old manifest, the new files would fail their checksums instead)."""
    root = str(tmp_path / "ckpt")
    write_in_another_process(root, 3, 1.0)
    real_check = ckpt_load._check_files
    calls = []

    def check_then_resave(*args, **kwargs):
        out = real_check(*args, **kwargs)
        if not calls:
            write_in_another_process(root, 3, 2.0)
        calls.append(1)
        return out

    monkeypatch.setattr(ckpt_load, "_check_files", check_then_resave)
    _, ps, model = filled(0.0)
    loaded = load_checkpoint(root, model, None, None, ps, LoadOptions(load_rng=False))
    assert (loaded.iteration, loaded.consumed_samples) == (3, 2)
    assert 1.0 not in weight_values(model) and 2.0 in weight_values(model)
    _, _, again = filled(0.0)    # (vocabulary padding rows are not saved: they stay 0)
    load_checkpoint(root, again, None, None, ps, LoadOptions(load_rng=False))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert len(calls) == 3
    assert (f" {iteration_dir(root, 3)} was replaced while it was read (a live job "
            "re-saved it): reading it again") in capsys.readouterr().out


def test_a_directory_resaved_on_every_read_is_one_error(tmp_path, monkeypatch):
    cfg, ps, writer = filled(1.0)
    root = str(tmp_path / "ckpt")
    save_checkpoint(root, 3, writer, None, None, ps, cfg.to_dict(), 1, save_optim=False,
                    save_rng=False)
    real_check = ckpt_load._check_files

    def check_then_resave(*args, **kwargs):
        out = real_check(*args, **kwargs)
        save_checkpoint(root, 3, writer, None, None, ps, cfg.to_dict(), 1, save_optim=False,
                        save_rng=False)
        return out

    monkeypatch.setattr(ckpt_load, "_check_files", check_then_resave)
    _, _, model = filled(0.0)
    with pytest.raises(CheckpointError, match=f"keeps re-saving {root}, or the ranks") as e:
        load_checkpoint(root, model, None, None, ps, LoadOptions(load_rng=False))
    assert str(e.value).startswith(f"{iteration_dir(root, 3)} was replaced while it was "
                                   "read (a live job re-saved it); 3 reads in a row")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A checkpoint directory (iterations 2 and 4 published) as a live job leaves it in
    the middle of saving iteration 6: its lock (a running pid, a fresh heartbeat) and a
    half-written ``iter_0000006.tmp``; and a copy holding only iteration 4."""
    base = tmp_path_factory.mktemp("live")
    root, clean = str(base / "ckpt"), str(base / "clean")
    run_training(tiny_config(train={"train_iters": 4, "eval_interval": 2, "eval_iters": 1},
                             checkpoint={"save": root, "save_interval": 2}))
    only_iteration(root, clean, 4)
    sleeper = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(root, LOCK), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": sleeper.pid, "started": time.time(),
                   "heartbeat": time.time()}, f)
    half = iteration_dir(root, 6) + ".tmp"
    os.makedirs(half)
    for name in os.listdir(iteration_dir(root, 4)):
        if name.endswith(".distcp"):
            with open(os.path.join(iteration_dir(root, 4), name), "rb") as src:
                data = src.read()
            with open(os.path.join(half, name), "wb") as dst:
                dst.write(data[: len(data) // 2])
    yield root, clean
    sleeper.kill()
    sleeper.wait()


def _out(capsys) -> str:
    return capsys.readouterr().out


def test_tools_read_the_last_complete_iteration_beside_a_live_job(live, capsys, tmp_path):
    root, clean = live
    notice = " is saving to it; reading iteration 4, its newest published one"

    evaluate = load_tool("evaluate")
    assert evaluate.main(["--load", clean, "--no-progress"]) == 0
    want = _out(capsys).strip().splitlines()[-1]
    assert want.startswith("validation loss at iteration 4 |")
    assert evaluate.main(["--load", root, "--no-progress"]) == 0
    out = _out(capsys)
    assert out.strip().splitlines()[-1] == want and notice in out

    generate = load_tool("generate")
    argv = ["--prompt", "5 9 12", "--max-new-tokens", "5", "--temperature", "0"]
    assert generate.main(["--load", clean, *argv]) == 0
    want = _out(capsys).strip().splitlines()[-1]
    assert generate.main(["--load", root, *argv]) == 0
    out = _out(capsys)
    assert out.strip().splitlines()[-1] == want and notice in out

    convert = load_tool("convert_checkpoint")
    for src in (clean, root):
        assert convert.main(["--source", "megalite", "--target", "megalite-consolidated",
                             "--load-dir", src, "--save-dir", str(tmp_path / "full")]) == 0
        os.rename(tmp_path / "full" / "model.pt", tmp_path / f"{os.path.basename(src)}.pt")
    assert notice in _out(capsys)
    a, b = (torch.load(tmp_path / f"{n}.pt") for n in ("clean", "ckpt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.path.isdir(iteration_dir(root, 6) + ".tmp")  # readers leave it alone


def test_a_load_only_training_job_resumes_from_the_last_complete_iteration(live, capsys):
    root, clean = live
    resumed, c = run_training(tiny_config(train={"train_iters": 5},
                                          checkpoint={"load": root}))
    assert c.state.iteration == 5 and list(resumed.losses) == [5]
    assert "reading iteration 4, its newest published one" in _out(capsys)
    from_clean, _ = run_training(tiny_config(train={"train_iters": 5},
                                             checkpoint={"load": clean}))
    assert resumed.losses == from_clean.losses
    assert sorted(os.listdir(root)) == sorted([LOCK, "iter_0000002", "iter_0000004",
                                               "iter_0000006.tmp",
                                               "latest_checkpointed_iteration.txt"])
