"""Resuming under another layout continues the loss curve.

One world-8 run trains 10 + 3 iterations at (tp2, pp2, dp2) with the distributed optimizer
and saves at iteration 10; the checkpoint of iteration 10 is then resumed at
(tp1, pp1, dp1) in this process (plain optimizer) and at (tp4, pp1, dp2) on 8 ranks
(distributed optimizer): iterations 11..13 must match the uninterrupted run. The three
layouts are the ``reshard`` rows of ``tests/layouts.py``; its ``mla`` rows save multi-latent
attention at tp 2 + sp and resume it in one process.
"""

import json
import os

import pytest

from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import only_iteration, run_training

SAVE_AT, ITERS = 10, 13
ORIGINAL = by_name("reshard-tp2-pp2-dp2-distopt")
SINGLE = by_name("reshard-single")
TP4_DP2 = by_name("reshard-tp4-dp2-distopt")


def _train(rank, world_size, layout, checkpoint):
    result, _ = run_training(tiny(layout, train={"train_iters": ITERS}, checkpoint=checkpoint))
    return result.losses


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    save = str(tmp / "tp2pp2dp2")
    losses = run_distributed(ORIGINAL.world_size, _train, ORIGINAL,
                             {"save": save, "save_interval": SAVE_AT})
    return tmp, save, losses[-1]


def _assert_continues(resumed: dict, reference: dict) -> None:
    assert list(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    for it, loss in resumed.items():
        assert loss == pytest.approx(reference[it], rel=2e-6, abs=1e-6), it


def test_saved_layout_and_metadata(original):
    _, save, _ = original
    with open(os.path.join(save, f"iter_{SAVE_AT:07d}", "metadata.json")) as f:
        meta = json.load(f)
    assert meta["layout"] | {} == {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "etp": 2,
                                   "vpp": None, "world_size": 8}
    assert meta["optimizer_state"] == ["exp_avg", "exp_avg_sq"]
    assert meta["config"]["parallel"]["use_distributed_optimizer"] is True


def test_resume_at_tp1_pp1_dp1(original, capsys):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "to_tp1"), SAVE_AT)
    result, _ = run_training(tiny(SINGLE, train={"train_iters": ITERS},
                                  checkpoint={"load": load, "save": load}))
    _assert_continues(result.losses, reference)
    out = capsys.readouterr().out
    assert "saved at tp=2 pp=2 dp=2" in out and "re-seeded" in out


def test_resume_at_tp4_pp1_dp2(original):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "to_tp4"), SAVE_AT)
    losses = run_distributed(TP4_DP2.world_size, _train, TP4_DP2, {"load": load, "save": load})
    _assert_continues(losses[-1], reference)


def _train_short(rank, world_size, layout, checkpoint):
    result, _ = run_training(tiny(layout, train={"train_iters": 4}, checkpoint=checkpoint))
    return result.losses


def _save_short(layout, save: str) -> dict:
    """Train ``layout`` (2 ranks) for 4 iterations, saving at 2; its losses by iteration."""
    return run_distributed(2, _train_short, layout, {"save": save, "save_interval": 2})[-1]


def _resume_in_one_process(layout, load: str) -> dict:
    result, _ = run_training(tiny(layout, train={"train_iters": 4},
                                  checkpoint={"load": load, "save": load}))
    return result.losses


def _assert_short_continues(losses: dict, reference: dict) -> None:
    """Iterations 3 and 4 after a resume from iteration 2 are the uninterrupted run's."""
    assert list(losses) == [3, 4]
    for it, loss in losses.items():
        assert loss == pytest.approx(reference[it], rel=2e-6, abs=1e-6), it


def test_mla_checkpoint_resumes_at_another_tp(tmp_path):
    """Multi-latent attention saved at tp 2 + sp (its up projections split over tp, its
    down projections and latent norms whole on each rank) resumes in one process on the
    uninterrupted curve."""
    save = str(tmp_path / "tp2")
    reference = _save_short(by_name("reshard-tp2-sp-mla"), save)
    load = only_iteration(save, str(tmp_path / "to_tp1"), 2)
    _assert_short_continues(_resume_in_one_process(by_name("reshard-single-mla"), load),
                            reference)


def test_mtp_checkpoint_resumes_in_one_process(tmp_path):
    """Multi-token prediction saved at pp 2 (its depths on stage 1, beside a copy of the
    word embedding stored under the embedding's one key) resumes in one process on the
    uninterrupted curve (the depths restored: their gradients reach the shared weights)."""
    save = str(tmp_path / "pp2")
    reference = _save_short(by_name("reshard-pp2-mtp"), save)
    load = only_iteration(save, str(tmp_path / "to_pp1"), 2)
    _assert_short_continues(_resume_in_one_process(by_name("reshard-single-mtp"), load),
                            reference)


def test_zbv_checkpoint_resumes_at_other_placements(tmp_path):
    """A checkpoint saved under ZB-V's V placement (pipeline rank 0 holds the first and the
    last layer, the word embedding and its tied copy) holds global layer numbers: it
    resumes in one process and at pp 2 under 1F1B on the uninterrupted curve."""
    save = str(tmp_path / "zbv")
    reference = _save_short(by_name("reshard-pp2-zbv"), save)
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as f:
        assert json.load(f)["config"]["parallel"]["pipeline_schedule"] == "zbv"
    single = _resume_in_one_process(by_name("reshard-single-from-zbv"),
                                    only_iteration(save, str(tmp_path / "to_tp1"), 2))
    load = only_iteration(save, str(tmp_path / "to_pp2"), 2)
    pp2 = run_distributed(2, _train_short, by_name("reshard-pp2-from-zbv"),
                          {"load": load, "save": load})[-1]
    for losses in (single, pp2):
        _assert_short_continues(losses, reference)


def test_mtp_checkpoint_between_zbv_and_1f1b(tmp_path):
    """Multi-token prediction saved under ZB-V at pp 2 (the depths on pipeline rank 0's
    chunk 1 beside a copy of the word embedding that is not saved) resumes in one process
    and at pp 2 under 1F1B on the uninterrupted curve; saved under 1F1B, it resumes under
    ZB-V. The two schedules train the same curve."""
    zbv_row, pp2_row = by_name("reshard-pp2-zbv-mtp"), by_name("reshard-pp2-mtp4")
    zbv_save, pp2_save = str(tmp_path / "zbv"), str(tmp_path / "pp2")
    from_zbv, from_pp2 = _save_short(zbv_row, zbv_save), _save_short(pp2_row, pp2_save)
    for it, loss in from_zbv.items():
        assert loss == pytest.approx(from_pp2[it], rel=2e-6, abs=1e-6), it
    single = _resume_in_one_process(by_name("reshard-single-mtp4"),
                                    only_iteration(zbv_save, str(tmp_path / "zbv_to_1"), 2))
    _assert_short_continues(single, from_zbv)
    for row, save, reference in ((pp2_row, zbv_save, from_zbv), (zbv_row, pp2_save, from_pp2)):
        load = only_iteration(save, str(tmp_path / f"{row.name}_load"), 2)
        resumed = run_distributed(2, _train_short, row, {"load": load, "save": load})[-1]
        _assert_short_continues(resumed, reference)
