"""Exact resumption under tp=2 x dp=2, and the same loss curve as one process.

One world-4 call runs: (a) 6 iterations straight with sequence parallelism and dropout 0,
whose lm_loss / grad_norm must match a single-process run with twice the micro-batches;
(b) 6 iterations straight with dropout (the model-parallel RNG streams matter) and (c) the
same run as 3 iterations + save + resume for 3, which must give identical losses.
"""

import os

import pytest

from megalite.checkpoint import read_latest_iteration
from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import read_jsonl, run_training, tiny_config

ITERS = 6
INVARIANCE, RESUME = by_name("training-tp2-sp-dp2"), by_name("resume-tp2-dp2")


def _layout_body(rank, world_size, tmp):
    out = {}
    # (a) layout invariance: tp=2 with sequence parallelism, dp=2, metrics from one rank
    cfg = tiny(INVARIANCE, train={"train_iters": ITERS},
               logging={"metrics_jsonl": os.path.join(tmp, "tp2dp2.jsonl")})
    out["invariance"], _ = run_training(cfg)
    # (b) straight run with dropout, (c) the same in two halves through a checkpoint
    dropout = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
    cfg = tiny(RESUME, model=dropout, train={"train_iters": ITERS})
    out["straight"], _ = run_training(cfg)
    save = os.path.join(tmp, "ckpt")
    cfg = tiny(RESUME, model=dropout, train={"train_iters": ITERS, "exit_interval": ITERS // 2},
               checkpoint={"save": save})
    out["first_half"], _ = run_training(cfg)
    cfg = tiny(RESUME, model=dropout, train={"train_iters": ITERS},
               checkpoint={"save": save, "load": save})
    out["second_half"], _ = run_training(cfg)
    return {k: (v.losses, v.exit_reason, v.iteration) for k, v in out.items()}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    assert INVARIANCE.world_size == RESUME.world_size == 4
    tmp = str(tmp_path_factory.mktemp("layouts"))
    return tmp, run_distributed(4, _layout_body, tmp)


def test_resume_is_exact_under_tp2_dp2(world4):
    tmp, results = world4
    for r in results:
        straight, first, second = r["straight"][0], r["first_half"], r["second_half"]
        assert first[1:] == ("exit-interval", ITERS // 2)
        assert second[1:] == ("finished", ITERS)
        resumed = {**first[0], **second[0]}
        assert list(resumed) == list(range(1, ITERS + 1))
        assert resumed == straight            # bitwise the same loss at every iteration
    assert read_latest_iteration(os.path.join(tmp, "ckpt")) == ITERS
    files = sorted(os.listdir(os.path.join(tmp, "ckpt", "iter_0000003")))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                     "__3_0.distcp", "metadata.json"]      # DCP: every rank writes a share


def test_tp2_dp2_matches_single_process_and_metrics_file(world4, tmp_path):
    tmp, results = world4
    losses = [r["invariance"][0] for r in results]
    assert all(lo == losses[0] for lo in losses)      # every rank reports the same lm_loss
    ref_path = str(tmp_path / "single.jsonl")
    single, _ = run_training(tiny_config(train={"train_iters": ITERS},
                                         logging={"metrics_jsonl": ref_path}))
    rows, ref = read_jsonl(os.path.join(tmp, "tp2dp2.jsonl")), read_jsonl(ref_path)
    keys = {"iteration", "lm_loss", "grad_norm", "lr", "loss_scale", "skipped",
            "tokens_per_sec", "mfu"}
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))   # one writer
    for row, want in zip(rows, ref):
        assert set(row) == keys
        assert row["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)
        assert row["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert row["lr"] == want["lr"] and row["skipped"] is False
        assert row["tokens_per_sec"] > 0 and 0 < row["mfu"] < 1
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    assert [single.losses[i] for i in range(1, ITERS + 1)] == [r["lm_loss"] for r in ref]
