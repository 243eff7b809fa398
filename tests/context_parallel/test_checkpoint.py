"""Checkpoints across context-parallel sizes: cp holds no parameters, so a checkpoint saved
at cp 2 resumes at cp 1 (and one saved at cp 1 resumes at cp 2) on the uninterrupted loss
curve; at the same cp layout, with attention and hidden dropout on, the resumed run repeats
the uninterrupted one exactly (data position and every RNG stream, the per-cp-rank
attention dropout seeds included)."""

import dataclasses

import pytest

from tests.distributed.harness import run_distributed
from tests.layouts import by_name, tiny
from tests.training.common import only_iteration, run_training

SAVE_AT, ITERS = 2, 4
CP2 = by_name("cp-cp2-p2p")
SINGLE = dataclasses.replace(CP2, name="cp-single", world_size=1, parallel={})
DROPOUT = {"attention_dropout": 0.1, "hidden_dropout": 0.1}


def _train(rank, world_size, layout, checkpoint, model=None):
    cfg = tiny(layout, train={"train_iters": ITERS}, checkpoint=checkpoint,
               model=model or {})
    result, _ = run_training(cfg)
    return result.losses


def _run(layout, checkpoint, model=None):
    if layout.world_size == 1:
        return _train(0, 1, layout, checkpoint, model)
    return run_distributed(layout.world_size, _train, layout, checkpoint, model)[-1]


@pytest.mark.parametrize("saved,resumed", [(CP2, SINGLE), (SINGLE, CP2)],
                         ids=["cp2-to-cp1", "cp1-to-cp2"])
def test_resume_at_another_cp_size(tmp_path, saved, resumed):
    save = str(tmp_path / "saved")
    straight = _run(saved, {"save": save, "save_interval": SAVE_AT})
    load = only_iteration(save, str(tmp_path / "resume"), SAVE_AT)
    again = _run(resumed, {"load": load})
    assert list(again) == list(range(SAVE_AT + 1, ITERS + 1))
    for it, loss in again.items():
        assert loss == pytest.approx(straight[it], rel=2e-6, abs=1e-6), (it, again, straight)


def test_resume_at_the_same_cp_layout_is_exact_with_dropout(tmp_path):
    save = str(tmp_path / "saved")
    straight = _run(CP2, {"save": save, "save_interval": SAVE_AT}, DROPOUT)
    load = only_iteration(save, str(tmp_path / "resume"), SAVE_AT)
    again = _run(CP2, {"load": load}, DROPOUT)
    assert again == {it: straight[it] for it in range(SAVE_AT + 1, ITERS + 1)}
