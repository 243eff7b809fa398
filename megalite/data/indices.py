"""Index arithmetic of Megatron-Core's GPT and blended datasets, in numpy.

Given the same ``.bin/.idx``, seed, sequence length, split and sample count, these functions
produce the same arrays as Megatron-Core (``gpt_dataset.py``, ``blended_dataset.py`` and the
C++ ``helpers.cpp``), so samples come out identical and in the same order:

* document index  int32 [epochs * docs]: the split's documents tiled once per epoch and
  shuffled with ``numpy.random.RandomState(seed)``; when the last epoch is needed for less
  than 80% of its samples it is shuffled separately and appended (``separate_final_epoch``).
* sample index    int32/int64 [samples + 1, 2]: (position in the document index, token
  offset) where each sample starts. Sample i covers the flattened token stream
  ``[i * seq_length, (i + 1) * seq_length]`` -- seq_length + 1 tokens, the last one shared
  with sample i + 1 (the input/label shift).
* shuffle index   uint32/int64 [samples]: a permutation of the samples (the separated final
  epoch's samples are permuted among themselves, after the others).
* blending index  int16 [size] + int64 [size]: which dataset and which of its samples feed
  each blended sample, chosen greedily by the largest ``weight * max(i, 1) - count`` error.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence

import numpy as np

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
SPLIT_NAMES = ("train", "valid", "test")


# ----------------------------------------------------------------------------------------
# Splits and blends
# ----------------------------------------------------------------------------------------
def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> three normalized weights (missing ones are 0)."""
    values = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise ValueError(f"--split must hold up to 3 non-negative weights with a positive "
                         f"sum, got {split!r}")
    return normalize(values + [0.0] * (3 - len(values)))


def split_matrix(weights: Sequence[float]) -> list[tuple[float, float] | None]:
    """Normalized weights -> per split (begin, end) fractions of the documents, or None."""
    ends = functools.reduce(lambda acc, w: acc + [acc[-1] + w], weights, [0.0])
    return [(lo, hi) if hi > lo else None for lo, hi in itertools.pairwise(ends)]


def split_documents(num_documents: int, bookends: tuple[float, float]) -> np.ndarray:
    """The documents ``[round(begin * n), round(end * n))`` of a split, int32."""
    begin = round(bookends[0] * float(num_documents))
    end = round(bookends[1] * float(num_documents))
    return np.arange(begin, end, dtype=np.int32)


def parse_blend(paths: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``['0.3', 'pA', '0.7', 'pB']`` -> (['pA', 'pB'], [0.3, 0.7]); ``['pA']`` -> (['pA'], None).

    A list of prefixes without weights gives ``None`` weights (blend by dataset size).
    """
    paths = [p for item in paths for p in str(item).split()]
    if not paths:
        raise ValueError("empty data path")
    if len(paths) % 2 == 0:
        try:
            weights = [float(w) for w in paths[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            prefixes = [p.strip() for p in paths[1::2]]
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"blend weights must be non-negative with a positive sum, "
                                 f"got {weights}")
            return prefixes, weights
    for p in paths:
        try:
            float(p)
        except ValueError:
            continue
        raise ValueError(f"data path {' '.join(paths)!r} mixes weights and prefixes; give "
                         "'W1 PREFIX1 W2 PREFIX2 ...' or only prefixes")
    return [p.strip() for p in paths], None


def blend_component_sizes(weights: Sequence[float],
                          num_samples: int | None) -> list[int] | None:
    """Samples to build per blended component: ``ceil(num_samples * weight * 1.005)`` each."""
    if num_samples is None:
        return None
    return [math.ceil(num_samples * w * 1.005) for w in weights]


# ----------------------------------------------------------------------------------------
# GPT dataset indices
# ----------------------------------------------------------------------------------------
def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None,
                      add_extra_token: bool = True) -> int:
    """Epochs whose tokens cover ``num_samples * seq_length (+1)`` tokens (1 if unset)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + int(add_extra_token)
    return max(1, -(-requested // tokens_per_epoch))


def plan_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int | None,
                     num_epochs: int, add_extra_token: bool = True) -> tuple[bool, int]:
    """(separate_final_epoch, samples before the final epoch), per Megatron's 80% rule."""
    if num_epochs == 1 or num_samples is None:
        return False, 0
    extra = int(add_extra_token)
    sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - sans_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    assert 0 <= from_final <= per_epoch + 1, (from_final, per_epoch)
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), sans_final


def build_document_index(documents: np.ndarray, num_epochs: int,
                         rng: np.random.RandomState, separate_final_epoch: bool) -> np.ndarray:
    """int32 [num_epochs * len(documents)]: documents tiled per epoch, shuffled by ``rng``."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate([first, last])
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                       seq_length: int, num_epochs: int, tokens_per_epoch: int,
                       drop_last_partial_sequence: bool = True,
                       add_extra_token: bool = True) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset) where each sample starts.

    Vectorized equivalent of Megatron's ``build_sample_idx`` (helpers.cpp). Sample i starts
    at flattened token ``g = i * seq_length``; the row is recorded at the document holding the
    sample-before's last token ``g + extra - 1`` (so a sample ending exactly at a document's
    end points back into that document, as the C++ loop does), found by ``searchsorted`` in
    the cumulative document lengths. Row 0 is always (0, 0). Without dropping, a final
    partial sample ends at (last document, its length - extra).

    sequence_lengths: int32 [num sequences]; document_index: int32 [num_epochs * docs].
    dtype: int32 when every value fits (Megatron's choice), else int64.
    """
    extra = int(add_extra_token)
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - extra) // seq_length
    else:
        num_samples = math.ceil(np.float32(total - extra) / np.float32(seq_length))
    doc_lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    cumulative = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=cumulative[1:])
    if cumulative[-1] != total:
        raise ValueError(f"document index holds {cumulative[-1]} tokens, expected "
                         f"{num_epochs} x {tokens_per_epoch}")
    starts = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    anchor = starts + (extra - 1)  # last token of the previous sample (g - 1 without extra)
    doc = np.searchsorted(cumulative, anchor, side="right") - 1
    overflow = anchor >= total  # only the last sample, when partial samples are kept
    doc[overflow] = len(doc_lengths) - 1
    offset = starts - cumulative[np.minimum(doc, len(doc_lengths) - 1)]
    offset[overflow] = doc_lengths[-1] - extra
    limit = max(len(document_index), int(np.max(sequence_lengths, initial=0)))
    dtype = np.int32 if limit <= np.iinfo(np.int32).max else np.int64
    sample_index = np.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[0] = (0, 0)
    sample_index[1:, 0] = doc
    sample_index[1:, 1] = offset
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    """Permutation of [0, total_size): [0, num_samples) shuffled, then the rest shuffled."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int | None, seed: int,
                      drop_last_partial_sequence: bool = True,
                      add_extra_token: bool = True, progress=None):
    """(document index, sample index, shuffle index) for a GPT dataset split.

    sequence_lengths: int32 [all sequences of the .idx]; documents: int32 ids of the split.
    Draws from one ``RandomState(seed)`` in Megatron's order: document index, then shuffle.
    ``progress``: called with each index's name once it is built (a progress bar).
    """
    done = progress or (lambda name: None)
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[documents], dtype=np.int64))
    if tokens_per_epoch <= int(add_extra_token):
        raise ValueError(f"the split holds {tokens_per_epoch} tokens, too few for a sample")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples, add_extra_token)
    separate, sans_final = plan_final_epoch(tokens_per_epoch, seq_length, num_samples,
                                            num_epochs, add_extra_token)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    done("document index")
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length,
                                      num_epochs, tokens_per_epoch,
                                      drop_last_partial_sequence, add_extra_token)
    done("sample index")
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_final if separate else total, total, rng)
    done("shuffle index")
    return document_index, sample_index, shuffle_index


# ----------------------------------------------------------------------------------------
# Blending
# ----------------------------------------------------------------------------------------
def build_blending_indices(weights: Sequence[float], size: int):
    """(dataset index int16 [size], sample-within-dataset index int64 [size]).

    At step i pick the dataset with the largest ``weight * max(i, 1) - count`` (the first on
    ties) and hand out its next sample -- Megatron's ``build_blending_indices``.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    chosen = [0] * size
    if len(w) == 2:  # the common case, unrolled
        w0, w1 = w
        c0 = c1 = 0
        for i in range(size):
            s = float(i) if i > 1 else 1.0
            if w1 * s - c1 > w0 * s - c0:
                chosen[i] = 1
                c1 += 1
            else:
                c0 += 1
    else:
        ks = range(1, len(w))
        for i in range(size):
            s = float(i) if i > 1 else 1.0
            best, best_err = 0, w[0] * s - counts[0]
            for k in ks:
                err = w[k] * s - counts[k]
                if err > best_err:
                    best, best_err = k, err
            chosen[i] = best
            counts[best] += 1
    return _with_sample_numbers(np.asarray(chosen, dtype=np.int16), len(w))


def build_exhaustive_blending_indices(sizes: Sequence[int]):
    """Blend every sample of every dataset once, in proportion to ``sizes`` (weights None)."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    open_ = [k for k in range(len(sizes)) if sizes[k] > 0]
    chosen = []
    i = 0
    while open_:
        s = max(float(i), 1.0)
        best = max(open_, key=lambda k: (w[k] * s - counts[k], -k))
        chosen.append(best)
        counts[best] += 1
        if counts[best] == sizes[best]:
            open_.remove(best)
        i += 1
    return _with_sample_numbers(np.asarray(chosen, dtype=np.int16), len(sizes))


def _with_sample_numbers(dataset_index: np.ndarray, num_datasets: int):
    """Add, for each position, how many earlier positions chose the same dataset."""
    sample_index = np.zeros(len(dataset_index), dtype=np.int64)
    for k in range(num_datasets):
        where = np.flatnonzero(dataset_index == k)
        sample_index[where] = np.arange(len(where))
    return dataset_index, sample_index
