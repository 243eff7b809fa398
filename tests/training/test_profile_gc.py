"""``--manual-gc`` (collector off, collections at chosen iterations on every rank) and
``--profile`` (a torch.profiler trace of the configured iterations on the profiled ranks)."""

import gc
import glob
import json
import os

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.data.tokenizers import build_tokenizer
from megalite.training.build import default_datasets_provider
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config


class _RecordingDataset:
    """Delegates to a dataset; records whether automatic gc was on at each read."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.seen.append(gc.isenabled())
        return self.inner[i]


def _manual_gc_run(world_size=1, **train):
    seen = []

    def datasets(cfg, _):
        tokenizer = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
        train_ds, valid_ds, test_ds = default_datasets_provider(cfg, tokenizer)
        return _RecordingDataset(train_ds, seen), valid_ds, test_ds

    cfg = tiny_config(world_size, train={"train_iters": 7, "eval_interval": 4, "eval_iters": 1,
                                         "manual_gc": True, **train})
    # the vocabulary the default build would take from the tokenizer
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    collections = []

    def callback(phase, info):
        if phase == "start" and not gc.isenabled():  # while the collector is off
            collections.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        result, _ = run_training(cfg, datasets_provider=datasets)
    finally:
        gc.callbacks.remove(callback)
    return result, seen, collections


def test_manual_gc_collects_at_the_interval_and_around_eval():
    assert gc.isenabled()
    result, seen, collections = _manual_gc_run(manual_gc_interval=3)
    # the end-of-training evaluation (validation, test) is collected around too
    assert result.gc_collected_at == [3, "eval", "eval", 6] + ["eval"] * 4
    assert seen and not any(seen)             # the automatic collector was off throughout
    assert gc.isenabled()                     # and is back on afterwards
    # while it was off, only our full collections ran: one at the start + 8
    assert collections == [2] * 9


def test_manual_gc_interval_0_and_no_eval():
    result, _, _ = _manual_gc_run(manual_gc_interval=0, manual_gc_eval=False)
    assert result.gc_collected_at == []
    cfg = parse_args(["--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval"])
    assert (cfg.train.manual_gc, cfg.train.manual_gc_interval, cfg.train.manual_gc_eval) == (
        True, 5, False)
    with pytest.raises(ConfigError, match="manual_gc_interval must be >= 0"):
        parse_args(["--manual-gc-interval", "-1"])


def _gc_body(rank, world_size):
    result, seen, _ = _manual_gc_run(world_size, manual_gc_interval=2)
    return result.gc_collected_at, any(seen)


def test_manual_gc_on_all_ranks_at_the_same_iterations():
    per_rank = run_distributed(2, _gc_body)
    assert per_rank[0] == per_rank[1] == ([2, 4, "eval", "eval", 6] + ["eval"] * 4, False)


def _profiled_iterations(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted({int(e["name"].rsplit(" ", 1)[1]) for e in events
                   if e.get("name", "").startswith("megalite/iteration ")})


def _profile_body(rank, world_size, out):
    cfg = tiny_config(world_size, train={"train_iters": 6},
                      logging={"profile": True, "use_pytorch_profiler": True,
                               "profile_step_start": 2, "profile_step_end": 4,
                               "tensorboard_dir": out})
    run_training(cfg)


def test_profile_writes_a_trace_for_rank_0_covering_the_steps(tmp_path):
    out = str(tmp_path / "tb")
    run_distributed(2, _profile_body, out)
    traces = glob.glob(os.path.join(out, "*.pt.trace.json"))
    assert [os.path.basename(p).split(".")[0] for p in traces] == ["rank0"]
    assert _profiled_iterations(traces[0]) == [3, 4]  # iterations done 2 and 3


def test_profile_without_tensorboard_dir_uses_save_and_ranks_flag(tmp_path):
    save = str(tmp_path / "ckpt")
    cfg = tiny_config(train={"train_iters": 3}, checkpoint={"save": save},
                      logging={"profile": True, "profile_step_start": 0,
                               "profile_step_end": 1, "profile_ranks": [0]})
    run_training(cfg)
    traces = glob.glob(os.path.join(save, "profile", "rank0.*.pt.trace.json"))
    assert len(traces) == 1 and _profiled_iterations(traces[0]) == [1]
    cfg = parse_args(["--profile", "--profile-ranks", "0", "3", "--profile-step-start", "4",
                      "--profile-step-end", "6", "--use-pytorch-profiler"])
    assert cfg.logging.profile_ranks == [0, 3]
    with pytest.raises(ConfigError, match="--profile-step-start \\(6\\) must be >= 0 and"):
        parse_args(["--profile-step-start", "6", "--profile-step-end", "6"])


def _events(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _overlap_profile_body(rank, world_size, out, shapes):
    """dp 2, distributed optimizer, --overlap-param-gather: each step ends with the
    parameter all-gathers in flight in gloo's threads, the profiler stops there."""
    cfg = tiny_config(world_size, train={"train_iters": 5},
                      parallel={"use_distributed_optimizer": True,
                                "overlap_grad_reduce": True, "overlap_param_gather": True},
                      logging={"profile": True, "profile_step_start": 1,
                               "profile_step_end": 3, "profile_ranks": [0, 1],
                               "tensorboard_dir": out,
                               "pytorch_profiler_collect_shapes": shapes})
    result, _ = run_training(cfg)
    return result.losses


@pytest.mark.parametrize("shapes", [False, True])
def test_profile_stops_cleanly_with_gathers_in_flight(tmp_path, shapes):
    out = str(tmp_path / "tb")
    losses = run_distributed(2, _overlap_profile_body, out, shapes)
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 3, 4, 5]
    traces = sorted(glob.glob(os.path.join(out, "*.pt.trace.json")))
    assert [os.path.basename(p).split(".")[0] for p in traces] == ["rank0", "rank1"]
    for path in traces:
        assert _profiled_iterations(path) == [2, 3]
        with_dims = [e for e in _events(path) if "Input Dims" in e.get("args", {})]
        assert bool(with_dims) == shapes   # shapes only with --pytorch-profiler-collect-shapes


def test_profiler_drains_before_it_stops_on_its_own_thread(tmp_path):
    import threading

    import torch

    from megalite.training.profiling import StepProfiler

    seen = []
    prof = StepProfiler(True, 0, 1, str(tmp_path), 0,
                        before_stop=lambda: seen.append(torch.autograd._profiler_enabled()))
    with prof.iteration(0):
        torch.ones(3).sum()
    assert seen == [True] and prof.trace_written and not torch.autograd._profiler_enabled()
    # stopping from another thread is refused (kineto binds the profiler to its thread)
    other = StepProfiler(True, 0, 2, str(tmp_path / "b"), 0)
    errors = []
    with other.iteration(0):
        pass
    thread = threading.Thread(target=lambda: errors.append(_close_error(other)))
    thread.start()
    thread.join()
    assert errors == ["the profiler must be stopped on the thread that started it"]
    other.close()
    assert other.trace_written


def _close_error(prof):
    try:
        prof.close()
    except RuntimeError as exc:
        return str(exc)
    return None
