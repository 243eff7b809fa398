"""Shared set-up of the benchmark tests.

The benchmarks run in the test process: each test gets back the torch thread count and
``OMP_NUM_THREADS`` it started with (benchmarks set both for their own timing).
``pooled_ranks`` runs a benchmark's ranks on the test harness's live rank pools instead
of fresh spawned processes (:func:`tools.bench._ranks.run_on_ranks`), which saves each
test the ranks' start-up. The cp and largest-model tests keep fresh processes: that path
is tested too, and largest-model measures a rank's peak resident set since its start.
"""

import os

import pytest
import torch

from tools.bench import _ranks


@pytest.fixture(autouse=True)
def _restore_threads():
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture
def pooled_ranks(monkeypatch):
    from tests.distributed.harness import run_distributed

    def run_on_pool(body, world: int, *args, timeout: float = 600) -> list:
        return run_distributed(world, body, *args, timeout=timeout)

    monkeypatch.setattr(_ranks, "run_on_ranks", run_on_pool)
