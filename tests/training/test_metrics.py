"""Metrics sinks: the Megatron-style line, JSONL, TensorBoard, wandb (offline); timers."""

import io
import os
import re

import pytest

from megalite.config import LoggingConfig
from megalite.training.metrics import IterationMetrics, MetricsLogger
from megalite.training.timers import Timers
from tests.training.common import read_jsonl


def _metrics(i, loss, skipped=False):
    return IterationMetrics(iteration=i, lm_loss=loss, grad_norm=None if skipped else 0.5,
                            lr=1e-3, loss_scale=1024.0, skipped=skipped, tokens_per_sec=1e4,
                            mfu=0.25, elapsed_s=0.1, consumed_samples=8 * i,
                            global_batch_size=8)


def test_all_sinks(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lcfg = LoggingConfig(log_interval=2, metrics_jsonl=str(tmp_path / "m" / "metrics.jsonl"),
                         tensorboard_dir=str(tmp_path / "tb"), wandb_project="megalite-test",
                         wandb_exp_name="unit", wandb_save_dir=str(tmp_path / "wandb"))
    out = io.StringIO()
    log = MetricsLogger(lcfg, train_iters=4, enabled=True, config={"a": 1}, stream=out)
    log.record(_metrics(1, 4.0))
    log.record(_metrics(2, 3.0, skipped=True))
    log.record(_metrics(3, 2.0), extra={"validation_loss": 2.5, "validation_ppl": 12.18})
    log.record_eval(3, 2.5)
    log.record(_metrics(4, 1.0))
    log.close()

    lines = out.getvalue().splitlines()
    line = lines[0]
    assert re.match(r" \[.*\] iteration +2/ +4 \| consumed samples: +16 \| elapsed time per "
                    r"iteration \(ms\): 100\.0 \| learning rate: 1\.000000E-03 \| global batch "
                    r"size: +8 \| lm loss: 3\.500000E\+00 \| loss scale: 1024\.0 \| grad norm: "
                    r"skipped \| number of skipped iterations: +1 \| tokens/s: 10000\.0 \| "
                    r"MFU: 25\.00% \| ETA: 0:00:00 \|", line), line
    assert any("validation loss at iteration 3 | lm loss value: 2.500000E+00 | lm loss PPL: "
               "1.218249E+01" in x for x in lines)
    assert "iteration        4/       4" in lines[-1] and "grad norm: 0.500" in lines[-1]

    rows = read_jsonl(lcfg.metrics_jsonl)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[1] == {"iteration": 2, "lm_loss": 3.0, "grad_norm": None, "lr": 1e-3,
                       "loss_scale": 1024.0, "skipped": True, "tokens_per_sec": 1e4,
                       "mfu": 0.25}
    assert rows[2]["validation_loss"] == 2.5
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
    runs = os.listdir(tmp_path / "wandb" / "wandb")
    assert any(r.startswith("offline-run-") for r in runs)


def test_disabled_logger_writes_nothing(tmp_path):
    lcfg = LoggingConfig(log_interval=1, metrics_jsonl=str(tmp_path / "x.jsonl"))
    out = io.StringIO()
    log = MetricsLogger(lcfg, train_iters=2, enabled=False, stream=out)
    log.record(_metrics(1, 1.0))
    log.close()
    assert out.getvalue() == "" and not os.path.exists(lcfg.metrics_jsonl)


def test_timers_levels_and_summary():
    timers = Timers(log_level=1)
    with timers("forward-compute", log_level=1):
        pass
    with timers("grads-all-reduce", log_level=2):  # above the level: not recorded
        pass
    text = timers.summary(normalizer=1)
    assert text.startswith("forward-compute: ") and "grads-all-reduce" not in text
    with pytest.raises(RuntimeError, match="stopped without being started"):
        timers("forward-compute", log_level=1).stop()


def _tb_scalars(path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("on", [False, True])
def test_deepseek_v3_logging_flags(tmp_path, on):
    """--log-num-zeros-in-grad / --log-params-norm: Megatron's ``num zeros`` and ``params
    norm`` in the line after the grad norm, TensorBoard's num-zeros / params-norm, the
    JSONL's num_zeros / params_norm; --log-timers-to-tensorboard: ``<timer>-time``;
    --log-validation-ppl-to-tensorboard: ``lm loss validation ppl`` (off: only the loss)."""
    lcfg = LoggingConfig(log_interval=1, metrics_jsonl=str(tmp_path / "m.jsonl"),
                         tensorboard_dir=str(tmp_path / "tb"), log_timers_to_tensorboard=on,
                         log_validation_ppl_to_tensorboard=on)
    out = io.StringIO()
    log = MetricsLogger(lcfg, train_iters=2, enabled=True, stream=out)
    m = _metrics(1, 4.0)
    if on:   # what the loop fills in when the flags are given
        m.num_zeros, m.params_norm, m.max_attention_logit = 96, 12.5, 31.25
    log.record(m)
    log.record_eval(1, 2.5)
    log.record_timers(1, {"forward-backward": 12.0, "optimizer": 3.0})
    log.close()
    line = out.getvalue().splitlines()[0]
    row = read_jsonl(lcfg.metrics_jsonl)[0]
    scalars = _tb_scalars(tmp_path / "tb")
    assert scalars["lm loss validation"] == [(1, 2.5)]
    if on:
        assert ("| grad norm: 0.500 | num zeros: 96 | params norm: 12.500 | max attention "
                "logit: 31.250 | number of") in line
        assert (row["num_zeros"], row["params_norm"]) == (96, 12.5)
        assert row["max_attention_logit"] == 31.25   # --log-max-attention-logit, --qk-clip
        assert scalars["num-zeros"] == [(1, 96.0)] and scalars["params-norm"] == [(1, 12.5)]
        assert scalars["max_attention_logit"] == [(1, 31.25)]
        assert scalars["forward-backward-time"] == [(1, 12.0)]
        assert scalars["optimizer-time"] == [(1, 3.0)]
        assert scalars["lm loss validation ppl"] == [(1, pytest.approx(12.182494))]
    else:
        assert "num zeros" not in line and "params norm" not in line
        assert "num_zeros" not in row and "params_norm" not in row
        assert "max attention logit" not in line and "max_attention_logit" not in row
        assert not {"num-zeros", "params-norm", "forward-backward-time",
                    "lm loss validation ppl", "max_attention_logit"} & set(scalars)


def test_timers_ms_per():
    timers = Timers(log_level=0)
    timers("evaluate").start()
    timers("evaluate").stop()
    times = timers.ms_per(normalizer=4)
    assert list(times) == ["evaluate"] and times["evaluate"] >= 0
    assert timers.ms_per()["evaluate"] == 0.0   # reset by the first read


def test_logging_level_sets_the_root_logger(tmp_path):
    """--logging-level: Python's logging level of the root logger (Megatron's meaning), set
    before any work."""
    import logging

    from tests.training.common import run_training, tiny_config

    root = logging.getLogger()
    before = root.level
    try:
        run_training(tiny_config(train={"train_iters": 1}, logging={"logging_level": 40}))
        assert root.level == logging.ERROR
        assert not logging.getLogger("megalite.data.builder").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(before)
