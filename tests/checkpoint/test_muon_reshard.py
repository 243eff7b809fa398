"""Muon's state (the matrices' momentum, the scalar optimizer's Adam moments) reshards on
load and resumes the curve.

A world-4 run at (tp2 + sp, dp2, ep2) with the distributed optimizer (each matrix
orthogonalised by its dp owner) trains 4 + 2 iterations and saves at iteration 4; that
checkpoint is resumed at the same layout (iterations 5 and 6 equal bit for bit), in this
process (plain optimizer), and at (pp2, dp2, ep2) under
``--data-parallel-sharding-strategy optim_grads_params`` (within float rounding). The
layouts are the ``reshard ... muon`` rows of ``tests/layouts.py``.
"""

import dataclasses
import json
import os

import pytest

from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import only_iteration, run_training

SAVE_AT, ITERS = 4, 6
ORIGINAL = by_name("reshard-tp2-sp-dp2-ep2-optim-muon")
SINGLE = by_name("reshard-single-muon")
ZERO3 = by_name("reshard-pp2-dp2-ep2-optim_grads_params-muon")


def _train(rank, world_size, layout, checkpoint):
    result, _ = run_training(tiny(layout, train={"train_iters": ITERS}, checkpoint=checkpoint))
    return result.losses


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_reshard")
    save = str(tmp / "saved")
    losses = run_distributed(ORIGINAL.world_size, _train, ORIGINAL,
                             {"save": save, "save_interval": SAVE_AT})
    return tmp, save, losses[-1]


def _assert_continues(resumed: dict, reference: dict, exact: bool = False) -> None:
    assert list(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    for it, loss in resumed.items():
        if exact:
            assert loss == reference[it], it
        else:
            assert loss == pytest.approx(reference[it], rel=2e-6, abs=1e-6), it


def test_saved_state_names(original):
    _, save, _ = original
    with open(os.path.join(save, f"iter_{SAVE_AT:07d}", "metadata.json")) as f:
        meta = json.load(f)
    assert meta["optimizer_state"] == ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    assert meta["config"]["optim"]["optimizer"] == "muon"


def test_resume_at_the_same_layout_is_bitwise(original):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "same"), SAVE_AT)
    losses = run_distributed(ORIGINAL.world_size, _train, ORIGINAL,
                             {"load": load, "save": load})
    _assert_continues(losses[-1], reference, exact=True)


def test_resume_in_one_process(original):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "single"), SAVE_AT)
    result, _ = run_training(tiny(SINGLE, train={"train_iters": ITERS},
                                  checkpoint={"load": load, "save": load}))
    _assert_continues(result.losses, reference)


def test_resume_at_pp2_under_zero3(original):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "zero3"), SAVE_AT)
    losses = run_distributed(ZERO3.world_size, _train, ZERO3, {"load": load, "save": load})
    _assert_continues(losses[-1], reference)


def test_another_optimizers_state_is_one_clear_error(tmp_path):
    """AdamW's checkpoint loaded into a Muon run: one CheckpointError naming both and the
    fix; with --no-load-optim the weights load and Muon starts fresh."""
    from megalite.checkpoint import CheckpointError

    save = str(tmp_path / "adam")
    run_training(tiny(dataclasses.replace(SINGLE, optim={}), train={"train_iters": 2},
                      checkpoint={"save": save, "save_interval": 2}))
    resume = tiny(SINGLE, train={"train_iters": 3}, checkpoint={"load": save})
    with pytest.raises(CheckpointError, match="holds --optimizer adam state and this run "
                                              "uses --optimizer muon; load it with "
                                              "--no-load-optim"):
        run_training(resume)
    fresh, _ = run_training(tiny(SINGLE, train={"train_iters": 3},
                                 checkpoint={"load": save, "no_load_optim": True}))
    assert list(fresh.losses) == [3]
