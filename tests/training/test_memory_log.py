"""The device-memory line and the peak in the metrics (megalite.training.memory_log), on CPU
with a fake stats source standing in for the CUDA allocator."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from megalite.training import memory_log
from megalite.training.memory_log import MB, MemoryReporter, MemoryStats, memory_line
from tests.distributed.harness import run_distributed
from tests.training.common import read_jsonl, run_training, tiny_config


def _stats(scale: float) -> MemoryStats:
    return MemoryStats(allocated=int(100.25 * scale * MB), max_allocated=int(300.5 * scale * MB),
                       reserved=int(512 * scale * MB), max_reserved=int(1024 * scale * MB))


def test_memory_line_is_megatrons_format():
    line = memory_line(3, 1, _stats(1.0))
    assert line == ("[Rank 3] (after 1 iterations) memory (MB) | allocated: 100.2 | "
                    "max allocated: 300.5 | reserved: 512.0 | max reserved: 1024.0")


def test_nothing_on_cpu():
    assert memory_log.cuda_memory_stats(torch.device("cpu")) is None
    ps = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    out = io.StringIO()
    reporter = MemoryReporter(ps, log_interval=2, stream=out)
    assert [reporter.after_iteration(i) for i in range(1, 5)] == [{}, {}, {}, {}]
    assert out.getvalue() == ""


def test_line_once_and_peak_on_log_iterations():
    ps = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    calls = []

    def source(device):
        calls.append(device)
        return _stats(len(calls))  # grows each time it is asked

    out = io.StringIO()
    reporter = MemoryReporter(ps, log_interval=3, stats_source=source, stream=out)
    extras = {i: reporter.after_iteration(i) for i in range(5, 13)}  # a resumed run
    assert out.getvalue().splitlines() == [memory_line(0, 5, _stats(1))]
    assert {i: e for i, e in extras.items() if e} == {
        5: {"mem_max_allocated_mb": 300.5}, 6: {"mem_max_allocated_mb": 601.0},
        9: {"mem_max_allocated_mb": 901.5}, 12: {"mem_max_allocated_mb": 1202.0}}
    assert len(calls) == 4


def _world_peak(rank, world_size):
    ps = SimpleNamespace(rank=rank, world_size=world_size, device=torch.device("cpu"))
    out = io.StringIO()
    reporter = MemoryReporter(ps, log_interval=10, stats_source=lambda d: _stats(rank + 1),
                              stream=out)
    return reporter.after_iteration(1), out.getvalue()


def test_metrics_get_the_world_peak_and_each_rank_prints_its_own():
    results = run_distributed(2, _world_peak)
    assert [r[0] for r in results] == [{"mem_max_allocated_mb": 601.0}] * 2
    assert [r[1] for r in results] == [memory_line(r, 1, _stats(r + 1)) + "\n" for r in (0, 1)]


def test_training_loop_logs_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory_log, "cuda_memory_stats", lambda device: _stats(2.0))
    path = tmp_path / "metrics.jsonl"
    cfg = tiny_config(train={"train_iters": 5},
                      logging={"log_interval": 2, "metrics_jsonl": str(path)})
    run_training(cfg)
    rows = read_jsonl(str(path))
    assert [r.get("mem_max_allocated_mb") for r in rows] == [601.0, 601.0, None, 601.0, None]
    lines = [x for x in capsys.readouterr().out.splitlines() if "memory (MB)" in x]
    assert lines == [memory_line(0, 1, _stats(2.0))]
