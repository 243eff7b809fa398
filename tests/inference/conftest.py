"""Fixtures shared by the tensor- and pipeline-parallel generation tests: the tiny
checkpoints (saved once per session) and one process's results on them."""

import pytest

from tests.inference.common import run_layout, save_checkpoints


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """{family: checkpoint directory} (:func:`tests.inference.common.save_checkpoints`)."""
    return save_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(saved):
    """{family: one process's results} (:func:`tests.inference.common.run_layout`)."""
    return {family: run_layout(root) for family, root in saved.items()}
