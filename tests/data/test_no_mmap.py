"""--no-mmap-bin-files: the .bin read with plain positioned reads gives the same samples."""

from __future__ import annotations

import pickle

import numpy as np

from megalite.config import DataConfig
from megalite.data import build_datasets
from megalite.data.bundled import BUNDLED_PREFIX
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import NullTokenizer


def test_plain_reads_match_mmap_on_the_bundled_corpus():
    mapped, plain = IndexedDataset(BUNDLED_PREFIX), IndexedDataset(BUNDLED_PREFIX, mmap=False)
    assert plain._bin is None and plain._bin_file is not None
    for i in (0, 1, len(mapped) // 2, len(mapped) - 1):
        assert np.array_equal(mapped[i], plain[i])
        assert np.array_equal(mapped.get(i, 3, 5), plain.get(i, 3, 5))
        assert np.array_equal(mapped.document(i), plain.document(i))
    assert plain.get(0, 0, 0).size == 0
    again = pickle.loads(pickle.dumps(plain))  # DataLoader workers reopen the same way
    assert again.mmap is False and np.array_equal(again[7], mapped[7])


def test_build_datasets_with_and_without_mmap_give_identical_samples(tmp_path):
    def samples(mmap: bool):
        cfg = DataConfig(data_path=[BUNDLED_PREFIX], split="98,2,0", mmap_bin_files=mmap,
                         data_cache_path=str(tmp_path / "cache"))
        train, _, _ = build_datasets(cfg, NullTokenizer(7999), seq_length=32, seed=3,
                                     num_samples=(40, 4, 0))
        return [train[i]["tokens"] for i in range(0, 40, 7)]

    for a, b in zip(samples(True), samples(False), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
