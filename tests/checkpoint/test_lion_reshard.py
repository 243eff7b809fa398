"""Lion's state (one ``exp_avg`` per linear weight, no step count; AdamW's moments for the
rest) reshards on load and resumes the curve.

A world-2 run under ``--data-parallel-sharding-strategy optim_grads_params`` (parameters,
gradients and Lion's state sharded over dp 2) trains 4 + 2 iterations and saves at
iteration 4; that checkpoint is resumed at the same layout (iterations 5 and 6 equal bit
for bit), in this process (plain optimizer) and at tp 2 + sp (within float rounding). The
layouts are the ``reshard ... lion`` rows of ``tests/layouts.py``.
"""

import dataclasses
import json
import os

import pytest

from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import only_iteration, run_training

SAVE_AT, ITERS = 4, 6
ORIGINAL = by_name("reshard-dp2-optim_grads_params-lion")
SINGLE = by_name("reshard-single-lion")
TP2 = by_name("reshard-tp2-sp-lion")


def _train(rank, world_size, layout, checkpoint):
    result, _ = run_training(tiny(layout, train={"train_iters": ITERS}, checkpoint=checkpoint))
    return result.losses


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lion_reshard")
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
    assert meta["optimizer_state"] == ["exp_avg", "exp_avg_sq"]   # Lion's, AdamW's
    assert meta["config"]["optim"]["optimizer"] == "lion"


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


def test_resume_at_tp2(original):
    tmp, save, reference = original
    load = only_iteration(save, str(tmp / "tp2"), SAVE_AT)
    losses = run_distributed(TP2.world_size, _train, TP2, {"load": load, "save": load})
    _assert_continues(losses[-1], reference)


def test_adam_state_into_a_lion_run_is_one_clear_error(original, tmp_path):
    """Lion's checkpoint loaded by an AdamW run: one CheckpointError naming both and the
    fix."""
    from megalite.checkpoint import CheckpointError

    _, save, _ = original
    adam = tiny(dataclasses.replace(SINGLE, optim={}), train={"train_iters": ITERS},
                checkpoint={"load": only_iteration(save, str(tmp_path / "a"), SAVE_AT)})
    with pytest.raises(CheckpointError, match="holds --optimizer lion state and this run "
                                              "uses --optimizer adam; load it with "
                                              "--no-load-optim"):
        run_training(adam)
