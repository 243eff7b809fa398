"""Checkpoint tests run in-process on one thread (as the training tests do): on a shared
2-core machine, intra-op threads of tiny models only fight each other."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
