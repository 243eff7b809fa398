"""Token ids beyond the vocabulary and datasets without tokens stop training with an error
naming the dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megalite.data.builder import DataBuildError
from megalite.data.gpt_dataset import TokenIdError
from megalite.data.indexed_dataset import bin_path
from tests.data.conftest import random_documents, write_dataset
from tests.training.common import tiny_config

VOCAB = 60  # tiny_config's NullTokenizer: ids in [0, 61)


def _cfg(prefix: str, **train):
    return tiny_config(data={"mock_data": False, "data_path": [prefix], "split": "1,0,0"},
                       train={"train_iters": 2, **train})


def _build(cfg):
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components

    ps = ParallelState.build(cfg.parallel)
    return build_components(cfg, ps, peak_probe_seconds=0.01), ps


def test_token_id_beyond_the_vocabulary_stops_before_any_update(tmp_path, rng):
    from megalite.training.loop import train

    prefix = write_dataset(tmp_path / "corpus", random_documents(rng, 40, 30, VOCAB, 5))
    size = (tmp_path / "corpus.bin").stat().st_size
    data = np.fromfile(bin_path(prefix), dtype=np.uint16)
    data[data.size // 2:] = 50000  # same size, ids far beyond the vocabulary
    data.tofile(bin_path(prefix))
    assert (tmp_path / "corpus.bin").stat().st_size == size
    c, ps = _build(_cfg(prefix))
    try:
        before = {k: v.clone() for k, v in c.model.state_dict().items()}
        with pytest.raises(TokenIdError, match=rf"{prefix}: document \d+ holds token id "
                                               r"50000 at position \d+, outside the "
                                               r"vocabulary of \d+ ids \(sample \d+ of "
                                               r"the train split\)"):
            train(c)
        assert c.state.iteration == 0
        after = c.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # no update
    finally:
        c.close()
        ps.destroy()


def test_ids_inside_the_vocabulary_pass_unchanged(tmp_path, rng):
    from megalite.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megalite.data.indexed_dataset import IndexedDataset

    prefix = write_dataset(tmp_path / "ok", random_documents(rng, 20, 30, VOCAB, 5))
    indexed = IndexedDataset(prefix)
    docs = np.arange(len(indexed), dtype=np.int32)
    kw = dict(seq_length=16, seed=1, eod=0, pad=0, cache_dir=str(tmp_path / "cache"))
    checked = GPTDataset(indexed, prefix, docs, None, "train",
                         GPTDatasetConfig(**kw, vocab_size=VOCAB))
    plain = GPTDataset(indexed, prefix, docs, None, "train", GPTDatasetConfig(**kw))
    for i in range(len(plain)):
        a, b = checked[i], plain[i]
        assert all(torch.equal(a[k], b[k]) for k in a)
    tight = GPTDataset(indexed, prefix, docs, None, "train",
                       GPTDatasetConfig(**kw, vocab_size=int(indexed.get(0).max())))
    with pytest.raises(TokenIdError, match="ok: document"):
        for i in range(len(tight)):
            tight[i]


def test_dataset_without_tokens_names_the_dataset_not_split(tmp_path):
    prefix = write_dataset(tmp_path / "empty", [])
    with pytest.raises(DataBuildError) as e:
        _build(_cfg(prefix))
    assert f"{prefix}: the dataset holds no tokens (0 documents)" in str(e.value)
    assert "--split" not in str(e.value)
