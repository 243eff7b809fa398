"""Shared helpers for the data pipeline tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetWriter

REPO = Path(__file__).resolve().parents[2]


def random_documents(rng: np.random.Generator, count: int, max_len: int, vocab: int,
                     min_len: int = 1) -> list[np.ndarray]:
    return [rng.integers(0, vocab, size=int(n)) for n in
            rng.integers(min_len, max_len + 1, size=count)]


def write_dataset(prefix: str, documents, dtype=np.uint16) -> str:
    with IndexedDatasetWriter(str(prefix), dtype) as out:
        for doc in documents:
            out.add_document(doc)
    return str(prefix)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
