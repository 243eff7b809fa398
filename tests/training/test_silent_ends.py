"""Runs that used to end silently: every fp16 step of a short run skipped (exit 5, one
line), a loss scale that fp32 cannot hold (exit 2 up front), no validation set (said once)."""

import subprocess

import pytest

from megalite.training.health import LossScaleError, LossScaleWatchdog
from tests.training.common import (
    ENTRYPOINT,
    PYTHON,
    run_training,
    subprocess_env,
    tiny_config,
    tiny_flags,
)


def _run(**overrides) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, ENTRYPOINT, *tiny_flags(**overrides)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=150, check=False)


@pytest.mark.parametrize("name", ["loss_scale", "initial_loss_scale"])
@pytest.mark.parametrize("value", [1e40, float("inf"), float("nan"), 0.0, -5.0])
def test_a_loss_scale_fp32_cannot_hold_is_refused_up_front(name, value):
    from megalite.config import ConfigError, OptimConfig

    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^{flag} \S+ is not a usable loss scale: it must "
                                          r"be above 0 and a finite fp32 number"):
        OptimConfig(**{name: value})
    OptimConfig(**{name: 3.4e38})    # the largest fp32 powers of ten still pass


def test_loss_scale_1e40_is_one_line_exit_2():
    proc = _run(**{"--fp16": None, "--loss-scale": "1e40", "--train-iters": 3})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("megalite: error") and "--loss-scale 1e+40" in lines[0], lines


def test_a_short_run_that_skipped_every_step_exits_5():
    """3 iterations at a static scale that overflows fp16 every step: fewer than the
    window of the running check, still not a silent exit 0."""
    proc = _run(**{"--fp16": None, "--loss-scale": "1e30", "--train-iters": 3,
                   "--global-batch-size": 2})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 5 and len(lines) == 1, proc.stderr
    assert lines[0] == (
        "megalite: error (rank 0): --loss-scale 1e+30 is too large: the gradients overflowed "
        "on every one of this run's 3 steps (iterations 1-3), so none updated the model; "
        "drop --loss-scale for dynamic loss scaling, lower it, or use --bf16"), lines


def test_the_end_check_leaves_runs_that_updated_or_back_off_alone():
    static = LossScaleWatchdog(fp16=True, static_scale=1e30, min_scale=1.0)
    static.after_step(1, False, None, 1e30, 4.0)
    static.after_step(2, True, 1.0, 1e30, 4.0)      # one step updated: not every step
    static.at_end(2)
    dynamic = LossScaleWatchdog(fp16=True, static_scale=None, min_scale=1.0)
    for i in range(1, 4):                            # halving from 2^32: backing off
        dynamic.after_step(i, False, None, 2.0 ** (32 - i), 4.0)
    dynamic.at_end(3)
    stuck = LossScaleWatchdog(fp16=True, static_scale=None, min_scale=1.0)
    stuck.after_step(1, False, None, 1.0, 4.0)
    with pytest.raises(LossScaleError, match="--min-loss-scale 1 .*this run's 1 steps"):
        stuck.at_end(1)
    LossScaleWatchdog(fp16=True, static_scale=1e30, min_scale=1.0).at_end(0)   # no steps


def test_no_validation_set_is_said_once(capsys):
    """What --split 100,0,0 gives: a training set and no validation set."""
    from megalite.data.tokenizers import build_tokenizer
    from megalite.training.build import default_datasets_provider

    def datasets(cfg, _):
        tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
        return default_datasets_provider(cfg, tokenizer)[0], None, None

    cfg = tiny_config(train={"train_iters": 4, "eval_iters": 2, "eval_interval": 2})
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    result, _ = run_training(cfg, datasets_provider=datasets)
    assert result.iteration == 4 and result.valid_losses == {}
    assert capsys.readouterr().out.count(" no validation set (") == 1
