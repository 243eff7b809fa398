"""build_datasets under torch.distributed: rank 0 builds the caches, the others load them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data.conftest import random_documents, write_dataset
from tests.distributed.harness import DistributedTestError, run_distributed


def _build(rank, world_size, prefix, cache_dir):
    from megalite.config import DataConfig
    from megalite.data import build_datasets
    from megalite.data.tokenizers import NullTokenizer

    cfg = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=cache_dir)
    train, valid, _ = build_datasets(cfg, NullTokenizer(999), 16, 5, (200, 20, 0))
    return train.built_anew, valid.built_anew, train[7]["tokens"].tolist()


def test_rank_zero_builds_first(tmp_path):
    docs = random_documents(np.random.default_rng(0), 100, 50, 999)
    prefix = write_dataset(tmp_path / "d", docs)
    (r0_train, r0_valid, r0_tokens), (r1_train, r1_valid, r1_tokens) = run_distributed(
        2, _build, prefix, str(tmp_path / "cache"))
    assert r0_train and r0_valid  # rank 0 built and cached
    assert not r1_train and not r1_valid  # rank 1 only loaded
    assert r0_tokens == r1_tokens


def test_a_failure_on_rank_zero_reaches_every_rank(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(2, _build, str(tmp_path / "missing"), str(tmp_path / "cache"),
                        timeout=60)
    message = str(info.value)
    assert "missing.idx: file not found" in message
    assert "rank 0 failed to build the datasets" in message  # rank 1 did not hang
