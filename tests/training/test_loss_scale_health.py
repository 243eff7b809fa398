"""fp16 loss scaling that cannot learn stops with LossScaleError (megalite.training.health)."""

from __future__ import annotations

import os

import pytest

from megalite.checkpoint import read_latest_iteration
from megalite.training.health import WINDOW, LossScaleError, LossScaleWatchdog
from megalite.training.loop import LossScaleError as LoopLossScaleError
from tests.training.common import run_training, tiny_config


# -- the watchdog alone -------------------------------------------------------------------
def feed(w, steps, start=1):
    for i, (updated, norm, scale) in enumerate(steps, start):
        w.after_step(i, updated, norm, scale, lm_loss=4.0)


def test_static_scale_every_step_skipped():
    w = LossScaleWatchdog(fp16=True, static_scale=1e30, min_scale=1.0)
    feed(w, [(False, None, 1e30)] * (WINDOW - 1))
    with pytest.raises(LossScaleError, match=r"--loss-scale 1e\+30 is too large.*iterations "
                                             r"1-10.*drop --loss-scale"):
        feed(w, [(False, None, 1e30)], start=WINDOW)


def test_dynamic_backoff_is_fine_until_stuck_at_min_scale():
    w = LossScaleWatchdog(fp16=True, static_scale=None, min_scale=1.0)
    # 40 skipped steps halving from 2^32: backing off, not stuck
    feed(w, [(False, None, 2.0 ** (32 - k)) for k in range(1, 33)])
    feed(w, [(True, 1.5, 1.0), (False, None, 1.0)] * 20)   # recovers in between: fine
    with pytest.raises(LossScaleError, match="--min-loss-scale 1 .*--bf16"):
        feed(w, [(False, None, 1.0)] * WINDOW)


def test_zero_gradients_for_a_window():
    w = LossScaleWatchdog(fp16=True, static_scale=1e-30, min_scale=1.0)
    feed(w, [(True, 0.0, 1e-30)] * (WINDOW - 1) + [(True, 0.3, 1e-30)])  # one non-zero
    feed(w, [(True, 0.0, 1e-30)] * (WINDOW - 1))
    with pytest.raises(LossScaleError, match="--loss-scale 1e-30 underflows every gradient"):
        feed(w, [(True, 0.0, 1e-30)])
    # a zero loss legitimately has zero gradients; dynamic names the flags to raise
    w = LossScaleWatchdog(fp16=True, static_scale=None, min_scale=1.0)
    for i in range(2 * WINDOW):
        w.after_step(i, True, 0.0, 1.0, lm_loss=0.0)
    with pytest.raises(LossScaleError, match="--initial-loss-scale / --min-loss-scale"):
        feed(w, [(True, 0.0, 1.0)] * WINDOW)


def test_not_fp16_never_fires():
    w = LossScaleWatchdog(fp16=False, static_scale=None, min_scale=1.0)
    feed(w, [(False, None, 1.0)] * 30 + [(True, 0.0, 1.0)] * 30)


# -- tiny runs ----------------------------------------------------------------------------
def _stops_before_checkpoint(tmp_path, optim, match):
    save = str(tmp_path / "ckpt")
    cfg = tiny_config(model={"fp16": True}, optim=optim,
                      train={"train_iters": WINDOW + 3, "global_batch_size": 2},
                      checkpoint={"save": save, "save_interval": 4})
    with pytest.raises(LoopLossScaleError, match=match):
        run_training(cfg)
    assert read_latest_iteration(save) == 8                 # 4 and 8 saved, not 10+
    iters = [int(d[5:]) for d in os.listdir(save) if d.startswith("iter_")]
    assert max(iters) == 8


def test_run_with_too_large_static_scale_stops(tmp_path):
    _stops_before_checkpoint(tmp_path, {"loss_scale": 1e30},
                             r"--loss-scale 1e\+30 is too large.*iterations 1-10")


def test_run_stuck_at_min_loss_scale_stops(tmp_path):
    # the scale starts at the minimum and every fp16 gradient overflows at 1e30
    _stops_before_checkpoint(tmp_path, {"initial_loss_scale": 1e30, "min_loss_scale": 1e30},
                             "--min-loss-scale 1e\\+30")


def test_run_with_underflowing_static_scale_stops(tmp_path):
    _stops_before_checkpoint(tmp_path, {"loss_scale": 1e-30},
                             "exactly 0 .*--loss-scale 1e-30 underflows every gradient")


@pytest.mark.parametrize("model", [{"fp16": True}, {"bf16": True}])
def test_healthy_runs_do_not_stop(model):
    # dynamic fp16 from 2^22 with hysteresis 1: skips its first steps, then learns
    cfg = tiny_config(model=model, optim={"initial_loss_scale": 2.0 ** 22, "hysteresis": 1},
                      train={"train_iters": WINDOW + 4, "global_batch_size": 2})
    result, _ = run_training(cfg)
    assert result.iteration == WINDOW + 4
