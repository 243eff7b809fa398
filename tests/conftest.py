"""Shared pytest setup.

* Tests run on CPU/gloo on any host: ``MEGALITE_DEVICE=cpu`` is set here, at import time,
  so megalite's device choice (:mod:`megalite.parallel.device`) picks the CPU in this
  process and in every rank or entrypoint subprocess the tests start (they inherit the
  environment). ``MEGALITE_TEST_DEVICE=cuda`` (or ``auto``) runs them on that device
  instead.
* Tests marked ``gpu`` need a CUDA GPU (``make test-gpu`` runs them); they ask for it
  explicitly (``--device cuda``) and are skipped, with the reason, where there is none.
* Rank pools are closed when the session ends.
"""

import os

import pytest

os.environ["MEGALITE_DEVICE"] = os.environ.get("MEGALITE_TEST_DEVICE", "cpu")


def _no_gpu_reason() -> str | None:
    import torch

    if torch.version.cuda is None:
        return f"needs a CUDA GPU; this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; torch.cuda.is_available() is False on this host"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _no_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from tests.distributed.harness import close_pools

    close_pools()
