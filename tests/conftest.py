"""Shared pytest setup: rank pools are closed when the session ends."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    from tests.distributed.harness import close_pools

    close_pools()
