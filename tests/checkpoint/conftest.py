"""Shared by the checkpoint tests: a one-process run's checkpoints to damage copies of,
and the imports of the trained Megatron fixtures."""

from __future__ import annotations

import shutil

import pytest

from tests.training.common import run_training, tiny_config


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{trained Megatron fixture: the checkpoint its import wrote}, each imported at its
    first use in the test module (test_megatron_resume.py, test_megatron_export_optimizer.py)."""
    from tests.checkpoint.test_megatron_import import Imported

    return Imported(tmp_path_factory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of iterations 2 and 4 (one process), made once per test module."""
    save = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_training(tiny_config(train={"train_iters": 4},
                             checkpoint={"save": save, "save_interval": 2}))
    return save


def load_iteration(world_size: int = 1, **checkpoint) -> int:
    """Build a tiny run that loads ``checkpoint``; the iteration it resumes at."""
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components

    cfg = tiny_config(world_size, train={"train_iters": 4}, checkpoint=checkpoint)
    ps = ParallelState.build(cfg.parallel)
    try:
        c = build_components(cfg, ps, peak_probe_seconds=0.01)
        c.close()
        return c.state.iteration
    finally:
        ps.destroy()


def copy_checkpoints(saved: str, tmp_path) -> str:
    """A copy of the checkpoint directory ``saved`` under ``tmp_path`` (to damage)."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved, dst)
    return dst
