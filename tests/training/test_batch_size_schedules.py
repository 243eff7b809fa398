"""Sample-based training, batch-size ramp-up / step schedules and their LR schedules.

Expected values are hand-computed from Megatron's rules: the ramp-up calculator
(``start + floor(consumed / (ramp / n)) * increment`` until ``ramp`` samples), the step
schedule (batch of the last threshold reached, thresholds in tokens // seq_length), and
the LR scheduler stepped by the samples of each update.
"""

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.optim.lr_schedule import LRScheduler
from megalite.config.batch_schedule import BatchSchedule, parse_step_schedule
from tests.distributed.harness import run_distributed
from tests.training.common import read_jsonl, run_training, tiny_config


# -- the schedule itself ----------------------------------------------------------------
def test_step_schedule_parses_token_thresholds_with_suffixes():
    # the GPT-3 175B script's schedule at seq_length 2048: tokens // 2048 = samples
    assert parse_step_schedule("0:16 2.4B:320 4.8B:624", 2048) == [
        (0, 16), (1_171_875, 320), (2_343_750, 624)]
    assert parse_step_schedule("0:8, 1.5K:16 2m:32 1T:64", 100) == [
        (0, 8), (15, 16), (20_000, 32), (10_000_000_000, 64)]
    s = BatchSchedule(tuple(parse_step_schedule("0:16 2.4B:320 4.8B:624", 2048)))
    assert [s.global_batch_size(c) for c in (0, 1_171_874, 1_171_875, 2_343_749,
                                              2_343_750, 10 ** 9)] == [16, 16, 320, 320,
                                                                       624, 624]
    assert s.variable and s.final_batch_size == 624


@pytest.mark.parametrize("text, match", [
    ("16:8 32:16", "must start at threshold 0"),
    ("0:8 3K:16 2K:32", "thresholds must increase"),
    ("0:8 4", "is not THRESHOLD:BATCH_SIZE"),
    ("0:8 1X:16", "is not a number"),
])
def test_step_schedule_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_step_schedule(text, 16)


def _megatron_rampup(consumed, start, inc, ramp, gbs):
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update, as written there."""
    if consumed > ramp:
        return gbs
    per_increment = ramp / ((gbs - start) // inc)
    return start + int(consumed / per_increment) * inc


@pytest.mark.parametrize("start, inc, ramp, gbs", [(16, 16, 300, 64), (4, 2, 1000, 16),
                                                   (8, 4, 100, 20)])
def test_rampup_matches_megatron_rule(start, inc, ramp, gbs):
    cfg = tiny_config(train={"rampup_batch_size": [start, inc, ramp], "global_batch_size": gbs,
                             "micro_batch_size": 2})
    s = BatchSchedule.from_config(cfg.train, cfg.model.seq_length)
    for consumed in range(0, 2 * ramp + 5):
        assert s.global_batch_size(consumed) == _megatron_rampup(consumed, start, inc, ramp,
                                                                 gbs), consumed


def test_iterations_for_train_samples_drops_the_partial_batch():
    s = BatchSchedule(((0, 2), (4, 4), (12, 8)))
    # 2, 2, 4, 4 (12 consumed), then 8s: 20, 28, 36; a 4th 8 would exceed 40
    assert s.iterations_for(40) == 7 and s.consumed_after(7) == 36
    assert s.iterations_for(43) == 7 and s.iterations_for(44) == 8
    assert s.iterations_for(3) == 1 and s.consumed_after(1) == 2
    assert BatchSchedule.constant(8).iterations_for(63) == 7


# -- configuration checks ---------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--train-iters", "4", "--train-samples", "32"],
     "either --train-iters or --train-samples"),
    (["--train-iters", "4", "--lr-decay-samples", "32"],
     "--train-iters .* excludes --lr-decay-samples"),
    (["--train-iters", "4", "--lr-warmup-samples", "8"],
     "--train-iters .* excludes --lr-warmup-samples"),
    (["--train-samples", "64", "--lr-decay-iters", "4"],
     "--train-samples .* excludes --lr-decay-iters"),
    (["--train-samples", "64", "--lr-warmup-iters", "1"],
     "--train-samples .* excludes --lr-warmup-iters"),
    (["--train-samples", "64", "--lr-wsd-decay-iters", "1"],
     "--train-samples .* excludes --lr-wsd-decay-iters"),
    (["--train-samples", "64", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"],
     "--lr-warmup-fraction or --lr-warmup-samples"),
    (["--train-iters", "4", "--micro-batch-size", "4", "--step-batch-size-schedule",
      "0:4 160:6 320:8"], "entry 6 .* not divisible by micro_batch_size \\(4\\)"),
    (["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "12",
      "--rampup-batch-size", "4", "3", "100"], "multiple of INCREMENT"),
    (["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "9",
      "--rampup-batch-size", "3", "3", "100"], "entry 3 .* not divisible"),
    (["--train-iters", "4", "--global-batch-size", "16", "--step-batch-size-schedule",
      "0:4 160:8"], "differs from the last batch size"),
    (["--train-iters", "4", "--rampup-batch-size", "4", "4"], "takes 3 values"),
    (["--train-iters", "4", "--rampup-batch-size", "4", "4", "8", "--global-batch-size", "8",
      "--step-batch-size-schedule", "0:8"], "not both"),
])
def test_flag_combinations_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--seq-length", "16", *argv]).validate(1)


def test_schedule_sets_the_global_batch_and_checks_the_interleaved_pipeline():
    cfg = parse_args(["--seq-length", "16", "--train-iters", "4", "--micro-batch-size", "1",
                      "--step-batch-size-schedule", "0:4 1K:8"]).validate(2)
    assert cfg.train.global_batch_size == 8
    with pytest.raises(ConfigError, match=r"interleaved .* micro-batches \(3 = batch-size schedule "
                                          r"entry 3 from"):
        parse_args(["--seq-length", "16", "--train-iters", "4", "--micro-batch-size", "1",
                    "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1",
                    "--step-batch-size-schedule", "0:3 1K:8"]).validate(2)


# -- LR schedules in samples ------------------------------------------------------------
@pytest.mark.parametrize("style, extra_iters, extra_samples", [
    ("linear", {}, {}), ("cosine", {}, {}), ("constant", {}, {}),
    ("inverse-square-root", {}, {}),
    ("WSD", {"lr_wsd_decay_iters": 3}, {"lr_wsd_decay_samples": 24}),
])
def test_sample_based_lr_curve_equals_iteration_based(style, extra_iters, extra_samples):
    gbs = 8
    common = {"lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": style}
    it = tiny_config(train={"train_iters": 12}, optim={**common, "lr_warmup_iters": 2,
                                                       "lr_decay_iters": 10, **extra_iters})
    sa = tiny_config(train={"train_iters": None, "train_samples": 96},
                     optim={**common, "lr_warmup_iters": 0, "lr_warmup_samples": 16,
                            "lr_decay_samples": 80, **extra_samples})
    by_iters = LRScheduler.from_config(it.optim, 12)
    by_samples = LRScheduler.from_config(sa.optim, None, train_samples=96,
                                         global_batch_size=gbs)
    assert by_samples.unit == "samples" and by_samples.decay_steps == 80
    for k in range(14):
        assert by_samples.lr_at(k * gbs) == pytest.approx(by_iters.lr_at(k), rel=1e-12, abs=0)
    # iteration-based lengths under a sample-counting schedule are x global batch
    conv = LRScheduler.from_config(it.optim, 12, global_batch_size=gbs)
    assert (conv.warmup_steps, conv.decay_steps) == (16, 80)


def test_sample_based_run_matches_iteration_based_run(tmp_path):
    common = {"lr": 3e-3, "min_lr": 3e-4, "lr_decay_style": "cosine"}
    a, b = str(tmp_path / "iters.jsonl"), str(tmp_path / "samples.jsonl")
    run_training(tiny_config(train={"train_iters": 6},
                             optim={**common, "lr_warmup_iters": 2, "lr_decay_iters": 5},
                             logging={"metrics_jsonl": a}))
    # 52 samples = 6 full batches of 8 (the partial 7th is dropped)
    run_training(tiny_config(train={"train_iters": None, "train_samples": 52},
                             optim={**common, "lr_warmup_iters": 0, "lr_warmup_samples": 16,
                                    "lr_decay_samples": 40},
                             logging={"metrics_jsonl": b}))
    ra, rb = read_jsonl(a), read_jsonl(b)
    assert [r["iteration"] for r in rb] == list(range(1, 7))
    for x, y in zip(ra, rb):
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-6)
        assert "global_batch_size" not in y      # constant batch: no extra field


RAMP = {"rampup_batch_size": [2, 2, 12], "global_batch_size": 8, "micro_batch_size": 2}
RAMP_SIZES = [2, 2, 4, 6, 8, 8, 8]        # hand-computed: steps of 2 every 4 samples


def test_rampup_run_batch_sizes_consumed_samples_and_lr(tmp_path):
    path = str(tmp_path / "m.jsonl")
    optim = {"lr_warmup_iters": 1, "lr_decay_iters": 4}   # x 8: warm-up 8, decay 32 samples
    result, c = run_training(tiny_config(train={**RAMP, "train_iters": 7}, optim=optim,
                                         logging={"metrics_jsonl": path}))
    assert list(result.batch_sizes.values()) == RAMP_SIZES
    rows = read_jsonl(path)
    assert [r["global_batch_size"] for r in rows] == RAMP_SIZES
    assert c.state.consumed_train_samples == sum(RAMP_SIZES) == 38
    # the schedule advanced by each step's samples: update k used lr_at(samples before it)
    sched = LRScheduler(max_lr=3e-3, min_lr=3e-4, warmup_steps=8, decay_steps=32,
                        decay_style="cosine", unit="samples")
    before = [sum(RAMP_SIZES[:k]) for k in range(7)]
    assert before == [0, 2, 4, 8, 14, 22, 30]
    assert [r["lr"] for r in rows] == [sched.lr_at(s) for s in before]
    assert c.scheduler.num_steps == 38


def test_train_samples_with_a_step_schedule(tmp_path):
    # thresholds in tokens: 64 tokens / 16 = 4 samples, 192 / 16 = 12 samples
    train = {"train_iters": None, "train_samples": 40, "micro_batch_size": 2,
             "global_batch_size": None, "step_batch_size_schedule": "0:2 64:4 192:8"}
    result, c = run_training(tiny_config(train=train, optim={"lr_warmup_iters": 0}))
    assert list(result.batch_sizes.values()) == [2, 2, 4, 4, 8, 8, 8]   # 36 of 40 samples
    assert c.cfg.train.train_iters == 7 and c.state.consumed_train_samples == 36


def test_resume_mid_rampup_is_exact(tmp_path):
    save = str(tmp_path / "ckpt")
    straight, _ = run_training(tiny_config(train={**RAMP, "train_iters": 7}))
    first, _ = run_training(tiny_config(train={**RAMP, "train_iters": 7, "exit_interval": 3},
                                        checkpoint={"save": save}))
    second, c = run_training(tiny_config(train={**RAMP, "train_iters": 7},
                                         checkpoint={"save": save, "load": save}))
    assert first.iteration == 3 and list(second.losses) == [4, 5, 6, 7]
    assert {**first.batch_sizes, **second.batch_sizes} == straight.batch_sizes
    assert {**first.losses, **second.losses} == straight.losses    # bitwise
    assert c.state.consumed_train_samples == 38 and c.scheduler.num_steps == 38


def _dp2_rampup_body(rank, world_size):
    # micro 1 x dp 2 = 2 divides every batch of the ramp
    cfg = tiny_config(world_size, train={**RAMP, "train_iters": 7, "micro_batch_size": 1})
    result, _ = run_training(cfg)
    return result.losses, result.batch_sizes


def test_rampup_under_dp2_matches_one_process():
    single, _ = run_training(tiny_config(train={**RAMP, "train_iters": 7}))
    for losses, sizes in run_distributed(2, _dp2_rampup_body):
        assert list(sizes.values()) == RAMP_SIZES
        assert losses == pytest.approx(single.losses, rel=1e-5)


def test_rampup_flags_reach_the_entrypoint_config():
    cfg = parse_args(["--seq-length", "16", "--train-samples", "1000", "--micro-batch-size",
                      "2", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                      "--lr-decay-samples", "800", "--lr-warmup-samples", "80"]).validate(1)
    assert cfg.train.rampup_batch_size == [2, 2, 12]
    assert (cfg.optim.lr_decay_samples, cfg.optim.lr_warmup_samples) == (800, 80)
