"""GPTDataset items, caching, splits and build_datasets (single, blended, per split, mock)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from megalite.config import DataConfig
from megalite.data import build_datasets
from megalite.data.blended import BlendedDataset
from megalite.data.builder import DataBuildError
from megalite.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, make_item
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import NullTokenizer
from tests.data.conftest import random_documents, write_dataset

EOD = 999
TOKENIZER = NullTokenizer(EOD)  # eod 999, vocab 1000


def corpus(tmp_path, rng, name="c", count=200):
    docs = [np.append(d, EOD) for d in random_documents(rng, count, 60, EOD)]
    return write_dataset(tmp_path / name, docs), docs


def gpt(prefix, tmp_path, num_samples=300, seed=1, seq_length=32, **flags):
    config = GPTDatasetConfig(seq_length=seq_length, seed=seed, eod=EOD, pad=EOD,
                              cache_dir=str(tmp_path / "cache"), **flags)
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), num_samples,
                      "train", config)


def test_items_are_contiguous_windows_of_the_shuffled_stream(tmp_path, rng):
    prefix, docs = corpus(tmp_path, rng)
    ds = gpt(prefix, tmp_path)
    assert len(ds) >= 300
    stream = np.concatenate([docs[d] for d in ds.document_index])
    for idx in (0, 1, 17, len(ds) - 1):
        item = ds[idx]
        assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (32,)
        assert item["loss_mask"].dtype == torch.float32
        start = int(ds.shuffle_index[idx]) * 32
        np.testing.assert_array_equal(item["tokens"], stream[start:start + 32])
        np.testing.assert_array_equal(item["labels"], stream[start + 1:start + 33])
        assert item["loss_mask"].eq(1).all()
        assert item["position_ids"].tolist() == list(range(32))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_masks_and_position_ids():
    config = GPTDatasetConfig(seq_length=6, seed=0, eod=9, pad=0, reset_position_ids=True,
                              reset_attention_mask=True, eod_mask_loss=True)
    item = make_item(np.array([1, 2, 9, 3, 9, 4, 5]), 7, config)
    assert item["labels"].tolist() == [2, 9, 3, 9, 4, 5]
    assert item["loss_mask"].tolist() == [1, 1, 0, 1, 0, 1]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    mask = item["attention_mask"]
    assert mask.shape == (1, 6, 6) and mask.dtype == torch.bool
    allowed = (~mask[0]).int().tolist()
    assert allowed[3] == [0, 0, 0, 1, 0, 0]  # first token of document 2 sees only itself
    assert allowed[4] == [0, 0, 0, 1, 1, 0]
    assert allowed[1] == [1, 1, 0, 0, 0, 0]
    padded = make_item(np.array([1, 2, 3, 0, 0, 0, 0]), 3, config)
    assert padded["loss_mask"].tolist() == [1, 1, 0, 0, 0, 0]


def test_cache_is_reused_and_keyed_by_the_parameters(tmp_path, rng):
    prefix, _ = corpus(tmp_path, rng)
    first = gpt(prefix, tmp_path)
    assert first.built_anew
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and not [f for f in files if "tmp" in f]
    again = gpt(prefix, tmp_path)
    assert not again.built_anew
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    other = gpt(prefix, tmp_path, seed=2)
    assert other.built_anew and not np.array_equal(other.shuffle_index, first.shuffle_index)
    assert gpt(prefix, tmp_path, num_samples=301).built_anew
    assert len(os.listdir(tmp_path / "cache")) == 12
    # A dataset pickles without copying its cached (mmapped) indices.
    clone = pickle.loads(pickle.dumps(again))
    np.testing.assert_array_equal(clone[5]["tokens"], again[5]["tokens"])


def test_default_cache_location_is_next_to_the_data(tmp_path, rng):
    prefix, _ = corpus(tmp_path, rng)
    config = GPTDatasetConfig(seq_length=16, seed=1, eod=EOD, pad=EOD)
    GPTDataset(IndexedDataset(prefix), prefix, np.arange(10, dtype=np.int32), 20, "valid",
               config)
    assert len(os.listdir(tmp_path / "cache" / "GPTDataset_indices")) == 4


def data_cfg(**kw) -> DataConfig:
    return DataConfig(tokenizer_type="NullTokenizer", **kw)


def test_build_datasets_splits_by_document(tmp_path, rng):
    prefix, _ = corpus(tmp_path, rng)
    cfg = data_cfg(data_path=[prefix], split="80,15,5", data_cache_path=str(tmp_path / "dc"))
    train, valid, test = build_datasets(cfg, TOKENIZER, 16, 1234, (500, 50, 10))
    assert isinstance(train, GPTDataset) and len(train) >= 500
    assert train.documents.tolist() == list(range(160))
    assert valid.documents.tolist() == list(range(160, 190))
    assert test.documents.tolist() == list(range(190, 200))
    again = build_datasets(cfg, TOKENIZER, 16, 1234, (500, 50, 10))
    for a, b in zip((train, valid, test), again):
        assert not b.built_anew
        np.testing.assert_array_equal(a[3]["tokens"], b[3]["tokens"])
    _, none_valid, none_test = build_datasets(cfg, TOKENIZER, 16, 1234, (500, 0, 0))
    assert none_valid is None and none_test is None
    cfg = data_cfg(data_path=[prefix], split="100,0,0", data_cache_path=str(tmp_path / "dc"))
    assert build_datasets(cfg, TOKENIZER, 16, 1234, (500, 50, 10))[1:] == (None, None)


def test_weighted_blend(tmp_path, rng):
    a, _ = corpus(tmp_path, rng, "a")
    b, _ = corpus(tmp_path, rng, "b", count=100)
    cfg = data_cfg(data_path=["0.3", a, "0.7", b], split="90,10,0",
                   data_cache_path=str(tmp_path / "dc"))
    train, valid, test = build_datasets(cfg, TOKENIZER, 16, 7, (1000, 100, 0))
    assert isinstance(train, BlendedDataset) and len(train) == 1000 and test is None
    counts = np.bincount(np.asarray(train.dataset_index))
    assert counts.tolist() == [300, 700]
    # components build ceil(n * w * 1.005) samples (at least)
    assert len(train.datasets[0]) >= 302 and len(train.datasets[1]) >= 704
    assert train.datasets[0].num_samples == 302 and train.datasets[1].num_samples == 704
    again = build_datasets(cfg, TOKENIZER, 16, 7, (1000, 100, 0))[0]
    for i in (0, 1, 500, 999):
        np.testing.assert_array_equal(train[i]["tokens"], again[i]["tokens"])
    assert len(valid) == 100


def test_unweighted_blend_and_per_split_paths(tmp_path, rng):
    a, _ = corpus(tmp_path, rng, "a")
    b, _ = corpus(tmp_path, rng, "b", count=100)
    cfg = data_cfg(data_path=[a, b], split="1,0,0", data_cache_path=str(tmp_path / "dc"))
    train = build_datasets(cfg, TOKENIZER, 16, 7, (50, 0, 0))[0]
    assert isinstance(train, BlendedDataset) and len(train) == 50
    cfg = data_cfg(train_data_path=[a], valid_data_path=["1", a, "1", b],
                   data_cache_path=str(tmp_path / "dc"))
    train, valid, test = build_datasets(cfg, TOKENIZER, 16, 7, (100, 40, 10))
    assert isinstance(train, GPTDataset) and len(train.documents) == 200
    assert isinstance(valid, BlendedDataset) and len(valid) == 40 and test is None
    with pytest.raises(DataBuildError, match="not both"):
        build_datasets(data_cfg(data_path=[a], train_data_path=[b]), TOKENIZER, 16, 7,
                       (1, 1, 1))
    with pytest.raises(DataBuildError, match="no training data"):
        build_datasets(data_cfg(), TOKENIZER, 16, 7, (1, 1, 1))


def test_empty_train_split_is_an_error(tmp_path, rng):
    prefix, _ = corpus(tmp_path, rng, count=3)
    cfg = data_cfg(data_path=[prefix], split="1,1000,0", data_cache_path=str(tmp_path / "dc"))
    with pytest.raises(DataBuildError, match="the train split .* holds no tokens"):
        build_datasets(cfg, TOKENIZER, 16, 7, (10, 10, 0))


def test_mock_data():
    cfg = DataConfig(mock_data=True)
    tok = NullTokenizer(64)
    train, _, test = build_datasets(cfg, tok, 512, 1, (10, 5, 5))
    assert isinstance(train, MockGPTDataset) and len(train) >= 10
    item = train[0]
    assert item["tokens"].max() < tok.vocab_size and item["tokens"].min() >= 1
    doc = train.indexed.get(0)  # 1, 2, ... wrapped below the vocabulary, then eod
    assert doc[0] == 1 and doc[-1] == tok.eod and doc[:-1].max() < tok.eod
    assert isinstance(test, MockGPTDataset)
