"""megalite's datasets draw the samples Megatron-Core's draw: for the same corpus, seed,
sequence length, split and blend, every kept sample's tokens, labels, loss mask and
position ids (CRC-32s against ``tests/data/megatron/reference.json``, written by
Megatron-Core 0.19.2 itself with ``make_reference.py`` there) and each split's length.
So a run moved from Megatron-LM resumes on the data Megatron would have given it."""

from __future__ import annotations

import json
import os
import types

import pytest

from megalite.config import DataConfig
from megalite.data.builder import build_datasets
from tests.data.megatron.make_reference import (
    CASES,
    EOD,
    FIELDS,
    HERE,
    VOCAB,
    crc,
    data_path,
    kept,
    second_corpus,
)

with open(os.path.join(HERE, "reference.json")) as f:
    REFERENCE = json.load(f)


@pytest.fixture(scope="module")
def second(tmp_path_factory):
    return second_corpus(str(tmp_path_factory.mktemp("corpus") / "second"))


def test_reference_covers_splits_resets_blends_and_epochs():
    assert REFERENCE["made_by"].startswith("megatron-core ")
    assert set(REFERENCE["cases"]) == set(CASES) == {"single", "reset", "blend", "epochs"}
    epochs = REFERENCE["cases"]["epochs"]["0"]["len"]
    assert epochs == 5139 > CASES["epochs"]["sizes"][0]   # past two epochs of the corpus


@pytest.mark.parametrize("name", sorted(CASES))
def test_samples_equal_megatron_cores(tmp_path, second, name):
    case = CASES[name]
    data = DataConfig(data_path=data_path(case, second), split=case["split"],
                      data_cache_path=str(tmp_path / "cache"),
                      reset_position_ids=case.get("reset_position_ids", False),
                      eod_mask_loss=case.get("eod_mask_loss", False))
    tokenizer = types.SimpleNamespace(eod=EOD, pad=EOD, vocab_size=VOCAB)
    splits = build_datasets(data, tokenizer, case["seq"], case["seed"], tuple(case["sizes"]))
    want = REFERENCE["cases"][name]
    assert {str(i) for i, ds in enumerate(splits) if ds is not None} == set(want)
    for split, ref in want.items():
        ds = splits[int(split)]
        assert len(ds) == ref["len"], (name, split)
        rows = [ds[j] for j in kept(len(ds))]
        for field in FIELDS:
            got = [crc(row[field]) for row in rows]
            bad = [j for j, (a, b) in zip(kept(len(ds)), zip(got, ref[field])) if a != b]
            assert not bad, f"{name} split {split}: {field} differs at samples {bad[:5]}"
