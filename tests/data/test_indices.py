"""Megatron's index arithmetic: the vectorized sample index against a plain loop, the
document/shuffle indices, determinism, and the blending rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megalite.data.indices import (
    blend_component_sizes,
    build_blending_indices,
    build_document_index,
    build_exhaustive_blending_indices,
    build_gpt_indices,
    build_sample_index,
    build_shuffle_index,
    parse_blend,
    parse_split,
    plan_final_epoch,
    split_documents,
    split_matrix,
)


def sample_index_loop(sizes, document_index, seq_length, num_epochs, tokens_per_epoch,
                      drop_last=True, extra=1):
    """The sample index as a plain loop over documents: the semantics of Megatron's C++
    ``build_sample_idx``. Walk the documents, taking seq_length + extra tokens per sample;
    the next sample starts ``extra`` tokens before where this one stopped."""
    total = num_epochs * tokens_per_epoch
    if drop_last:
        num_samples = (total - extra) // seq_length
    else:
        num_samples = math.ceil(np.float32(total - extra) / np.float32(seq_length))
    rows = [(0, 0)]
    doc, offset = 0, 0
    while len(rows) <= num_samples:
        needed = seq_length + extra
        while needed != 0:
            available = int(sizes[document_index[doc]]) - offset
            needed -= available
            if needed <= 0:  # this document finishes the sample
                offset += needed + available - extra
                needed = 0
            elif doc == len(document_index) - 1:  # out of documents: a partial sample
                offset = int(sizes[document_index[doc]]) - extra
                break
            else:
                doc, offset = doc + 1, 0
        rows.append((doc, offset))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("seq_length", [2, 5, 16, 97])
def test_vectorized_sample_index_equals_the_loop(rng, extra, drop_last, seq_length):
    for trial in range(6):
        num_docs = int(rng.integers(1, 60))
        sizes = rng.integers(0 if trial % 2 else 1, 40, size=num_docs + 5).astype(np.int32)
        documents = np.arange(3, 3 + num_docs, dtype=np.int32)
        tokens_per_epoch = int(sizes[documents].sum())
        if tokens_per_epoch < seq_length + 2:
            continue
        for num_epochs in (1, 3):
            state = np.random.RandomState(trial)
            doc_index = build_document_index(documents, num_epochs, state, trial == 2)
            args = (sizes, doc_index, seq_length, num_epochs, tokens_per_epoch, drop_last)
            fast = build_sample_index(*args, add_extra_token=bool(extra))
            slow = sample_index_loop(*args, extra=extra)
            assert fast.dtype == np.int32
            np.testing.assert_array_equal(fast, slow)


def test_samples_tile_the_token_stream(rng):
    """Sample i is tokens [i*s, i*s + s] of the epochs' concatenated documents."""
    sizes = rng.integers(0, 30, size=40).astype(np.int32)
    documents = np.arange(40, dtype=np.int32)
    docs = [np.arange(n) + 1000 * d for d, n in enumerate(sizes)]
    doc_index, sample_index, _ = build_gpt_indices(sizes, documents, 11, 150, seed=5)
    stream = np.concatenate([docs[d] for d in doc_index])
    for i in range(len(sample_index) - 1):
        (d0, o0), (d1, o1) = sample_index[i], sample_index[i + 1]
        parts = ([docs[doc_index[d0]][o0:o1 + 1]] if d0 == d1 else
                 [docs[doc_index[d0]][o0:]] + [docs[doc_index[k]] for k in range(d0 + 1, d1)]
                 + [docs[doc_index[d1]][:o1 + 1]])
        np.testing.assert_array_equal(np.concatenate(parts), stream[i * 11:i * 11 + 12])


def test_document_index_matches_megatrons_construction():
    """Megatron fills an mgrid with the documents and shuffles it with RandomState(seed)."""
    documents = np.arange(10, 35, dtype=np.int32)
    ours = build_document_index(documents, 3, np.random.RandomState(42), False)
    grid = np.mgrid[0:3, 0:len(documents)][1]
    grid[:] = documents
    theirs = grid.reshape(-1).astype(np.int32)
    np.random.RandomState(42).shuffle(theirs)
    np.testing.assert_array_equal(ours, theirs)
    assert ours.dtype == np.int32


def test_shuffle_index():
    total = 100
    shuffle = build_shuffle_index(80, total, np.random.RandomState(0))
    assert shuffle.dtype == np.uint32
    assert sorted(shuffle[:80]) == list(range(80)) and sorted(shuffle[80:]) == list(range(80, 100))


def test_separate_final_epoch():
    sizes = np.full(50, 20, dtype=np.int32)  # 1000 tokens an epoch: 99 samples of 10
    documents = np.arange(50, dtype=np.int32)
    separate, sans_final = plan_final_epoch(1000, 10, 120, 2)
    assert separate and sans_final == 99  # 21 samples of the second epoch < 80% of 99
    doc_index, sample_index, shuffle = build_gpt_indices(sizes, documents, 10, 120, seed=3)
    assert sorted(doc_index[50:]) == list(range(50))  # last epoch shuffled on its own
    assert sorted(shuffle[:99]) == list(range(99))
    assert sorted(shuffle[99:]) == list(range(99, len(sample_index) - 1))
    assert not plan_final_epoch(1000, 10, 190, 2)[0]  # 91 >= 80% of 99: one shuffle


def test_indices_are_deterministic_in_the_seed(rng):
    sizes = rng.integers(1, 100, size=500).astype(np.int32)
    documents = np.arange(100, 400, dtype=np.int32)
    a = build_gpt_indices(sizes, documents, 64, 2000, seed=7)
    b = build_gpt_indices(sizes, documents, 64, 2000, seed=7)
    c = build_gpt_indices(sizes, documents, 64, 2000, seed=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[2], c[2])
    assert len(a[1]) - 1 >= 2000


def test_splits_and_blends():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    matrix = split_matrix(parse_split("98,2"))
    assert matrix[2] is None and matrix[1] == pytest.approx((0.98, 1.0))
    assert split_documents(1189, matrix[0]).tolist() == list(range(1165))
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a"]) == (["a"], None)
    assert parse_blend(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        parse_blend(["0.3", "a", "b"])
    assert blend_component_sizes([0.3, 0.7], 1000) == [302, 704]  # ceil(n * w * 1.005)


def blending_loop(weights, size):
    counts = [0] * len(weights)
    chosen = []
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        k = errors.index(max(errors))
        chosen.append(k)
        counts[k] += 1
    return chosen


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [0.2, 0.5, 0.3],
                                     [0.1, 0.2, 0.3, 0.4]])
def test_blending_follows_the_weights(weights):
    size = 5000
    dataset_index, sample_index = build_blending_indices(weights, size)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    assert dataset_index.tolist() == blending_loop(weights, size)
    counts = np.zeros(len(weights))
    for i, k in enumerate(dataset_index):
        assert sample_index[i] == counts[k]  # each dataset's samples in order
        counts[k] += 1
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0 + 1e-9)
    assert counts.tolist() == pytest.approx([w * size for w in weights], abs=1)


def test_exhaustive_blending_uses_every_sample_once():
    dataset_index, sample_index = build_exhaustive_blending_indices([3, 0, 7])
    assert np.bincount(dataset_index, minlength=3).tolist() == [3, 0, 7]
    assert sorted(sample_index[dataset_index == 2].tolist()) == list(range(7))
