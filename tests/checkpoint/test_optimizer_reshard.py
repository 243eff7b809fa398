"""Muon's and Lion's state reshards on load and resumes the curve (AdamW's:
``test_reshard.py``).

- Muon (the matrices' momentum, the scalar optimizer's Adam moments): a world-4 run at
  (tp2 + sp, dp2, ep2) with the distributed optimizer (each matrix orthogonalised by its
  dp owner) is resumed at the same layout, in this process (plain optimizer) and at
  (pp2, dp2, ep2) under ``--data-parallel-sharding-strategy optim_grads_params``.
- Lion (one ``exp_avg`` per linear weight, no step count; AdamW's moments for the rest):
  a world-2 run under ZeRO-3 (parameters, gradients and state sharded over dp 2) is
  resumed at the same layout, in this process and at tp 2 + sp.

Each trains 4 + 2 iterations and saves at iteration 4; the resumed iterations 5 and 6
equal the original's bit for bit at the same layout, within float rounding elsewhere. The
layouts are the ``reshard ... muon`` / ``reshard ... lion`` rows of ``tests/layouts.py``.
"""

import dataclasses
import json
import os

import pytest

from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import only_iteration, run_training

SAVE_AT, ITERS = 4, 6
# optimizer -> (the saved run, the layouts it resumes at, the state names it saves)
CASES = {
    "muon": ("reshard-tp2-sp-dp2-ep2-optim-muon",
             ("reshard-single-muon", "reshard-pp2-dp2-ep2-optim_grads_params-muon"),
             ["exp_avg", "exp_avg_sq", "momentum_buffer"]),
    "lion": ("reshard-dp2-optim_grads_params-lion",
             ("reshard-single-lion", "reshard-tp2-sp-lion"), ["exp_avg", "exp_avg_sq"]),
}
RESUMED = [(optimizer, name) for optimizer, (_, names, _) in CASES.items() for name in names]


def _train(rank, world_size, layout, checkpoint):
    result, _ = run_training(tiny(layout, train={"train_iters": ITERS}, checkpoint=checkpoint))
    return result.losses


def _run(layout, checkpoint) -> dict:
    """iteration -> loss of ``layout`` (on its ranks, or in this process at world 1)."""
    if layout.world_size == 1:
        return _train(0, 1, layout, checkpoint)
    return run_distributed(layout.world_size, _train, layout, checkpoint)[-1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """optimizer -> (directory, checkpoint root, the original run's losses): trained
    once each, when a test first asks."""
    runs = {}

    def get(optimizer):
        if optimizer not in runs:
            tmp = tmp_path_factory.mktemp(f"{optimizer}_reshard")
            save = str(tmp / "saved")
            losses = _run(by_name(CASES[optimizer][0]), {"save": save, "save_interval": SAVE_AT})
            runs[optimizer] = (tmp, save, losses)
        return runs[optimizer]
    return get


def _assert_continues(resumed: dict, reference: dict, exact: bool = False) -> None:
    assert list(resumed) == list(range(SAVE_AT + 1, ITERS + 1))
    for it, loss in resumed.items():
        if exact:
            assert loss == reference[it], it
        else:
            assert loss == pytest.approx(reference[it], rel=2e-6, abs=1e-6), it


@pytest.mark.parametrize("optimizer", list(CASES))
def test_saved_state_names(saved, optimizer):
    _, save, _ = saved(optimizer)
    with open(os.path.join(save, f"iter_{SAVE_AT:07d}", "metadata.json")) as f:
        meta = json.load(f)
    assert meta["optimizer_state"] == CASES[optimizer][2]
    assert meta["config"]["optim"]["optimizer"] == optimizer


@pytest.mark.parametrize("optimizer", list(CASES))
def test_resume_at_the_same_layout_is_bitwise(saved, optimizer):
    tmp, save, reference = saved(optimizer)
    load = only_iteration(save, str(tmp / "same"), SAVE_AT)
    losses = _run(by_name(CASES[optimizer][0]), {"load": load, "save": load})
    _assert_continues(losses, reference, exact=True)


@pytest.mark.parametrize("optimizer,name", RESUMED, ids=[n for _, n in RESUMED])
def test_resume_at_another_layout(saved, optimizer, name):
    tmp, save, reference = saved(optimizer)
    load = only_iteration(save, str(tmp / name), SAVE_AT)
    _assert_continues(_run(by_name(name), {"load": load, "save": load}), reference)


def test_another_optimizers_state_is_one_clear_error(saved, tmp_path):
    """AdamW's checkpoint loaded into a Muon run, and Lion's into an AdamW run: one
    CheckpointError naming both and the fix; with --no-load-optim the weights load and
    the optimizer starts fresh."""
    from megalite.checkpoint import CheckpointError

    single = by_name("reshard-single-muon")
    save = str(tmp_path / "adam")
    run_training(tiny(dataclasses.replace(single, optim={}), train={"train_iters": 2},
                      checkpoint={"save": save, "save_interval": 2}))
    resume = tiny(single, train={"train_iters": 3}, checkpoint={"load": save})
    with pytest.raises(CheckpointError, match="holds --optimizer adam state and this run "
                                              "uses --optimizer muon; load it with "
                                              "--no-load-optim"):
        run_training(resume)
    fresh, _ = run_training(tiny(single, train={"train_iters": 3},
                                 checkpoint={"load": save, "no_load_optim": True}))
    assert list(fresh.losses) == [3]
    _, lion, _ = saved("lion")
    adam = tiny(dataclasses.replace(by_name("reshard-single-lion"), optim={}),
                train={"train_iters": ITERS},
                checkpoint={"load": only_iteration(lion, str(tmp_path / "lion"), SAVE_AT)})
    with pytest.raises(CheckpointError, match="holds --optimizer lion state and this run "
                                              "uses --optimizer adam; load it with "
                                              "--no-load-optim"):
        run_training(adam)
