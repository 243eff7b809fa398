"""Training tests run in-process on one thread: on a 2-core machine shared with other
processes, intra-op threads spin against each other and make tiny models 50x slower."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
