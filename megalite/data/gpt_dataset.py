"""GPT pretraining samples over an indexed dataset, in Megatron-Core's order.

A :class:`GPTDataset` exposes one split (a contiguous range of documents) of a ``.bin/.idx``
as ``num_samples`` (or one epoch of) fixed-length samples. The three index arrays that
define it (see :mod:`megalite.data.indices`) are built once, saved atomically in
``--data-cache-path`` or else next to the data (``<data dir>/cache/GPTDataset_indices/``;
the user cache directory for data inside megalite's own tree, see
:mod:`megalite.data.cache_dirs`) under a name holding an md5 of every parameter they depend
on, and memory-mapped back by later runs and by the other ranks.

Each item is a dict of torch tensors, ``s = seq_length``:
    tokens        int64   [s]  input ids
    labels        int64   [s]  tokens shifted left by one (the next token)
    loss_mask     float32 [s]  0 where the input token is eod (with eod_mask_loss) and on
                               padding, else 1
    position_ids  int64   [s]  0..s-1, restarting after each eod with reset_position_ids
    attention_mask bool [1, s, s]  only with reset_attention_mask: True where attention is
                               masked (causal and within the document, Megatron's convention)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from megalite.data.cache_dirs import default_index_cache_dir
from megalite.data.indices import build_gpt_indices
from megalite.errors import DataError

logger = logging.getLogger(__name__)


def index_progress(desc: str, steps: int):
    """The index-building steps counted on stderr past 2 s (megalite.progress: a bar on a
    terminal, that goes when done; lines in a log)."""
    from megalite.progress import Progress

    return Progress(steps, desc, "step", leave=False)


@dataclass
class GPTDatasetConfig:
    """What a GPTDataset needs besides its documents (tokenizer ids, sample layout, cache)."""

    seq_length: int
    seed: int
    eod: int
    pad: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    cache_dir: str | None = None
    vocab_size: int | None = None  # bounds the mock data's ids; every sample's ids are checked
    add_extra_token: bool = True  # samples of seq_length + 1 tokens (input/label shift)
    drop_last_partial_validation_sequence: bool = True
    mmap_bin_files: bool = True  # False: read the .bin with plain reads (same tokens)


class TokenIdError(DataError, ValueError):
    """A token id outside ``[0, vocab_size)`` in a sample: the data does not fit the model."""


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens drawn from ``documents`` of ``indexed``.

    indexed:     an IndexedDataset (or anything with ``sequence_lengths`` and ``get``)
    prefix:      its path prefix, for the cache location and description (None: no cache)
    documents:   int32 sequence ids of this split
    num_samples: samples wanted (more epochs are added as needed); None for one epoch
    split_name:  "train", "valid" or "test"
    """

    def __init__(self, indexed, prefix: str | None, documents: np.ndarray,
                 num_samples: int | None, split_name: str, config: GPTDatasetConfig) -> None:
        self.indexed = indexed
        self.prefix = prefix
        self.documents = np.asarray(documents, dtype=np.int32)
        self.num_samples = num_samples
        self.split_name = split_name
        self.config = config
        self.drop_last = (split_name != "valid" or config.drop_last_partial_validation_sequence)
        self.description = self._describe()
        self.description_hash = hashlib.md5(
            json.dumps(self.description, indent=2).encode()).hexdigest()
        self.cache_paths = self._cache_paths()
        self.built_anew = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build()

    # -- indices ------------------------------------------------------------------------
    def _describe(self) -> dict:
        lengths = self.indexed.sequence_lengths
        docs = self.documents
        return {
            "class": type(self).__name__,
            "dataset_path": os.path.abspath(self.prefix) if self.prefix else None,
            "num_sequences": len(lengths),
            "num_tokens": int(np.sum(lengths, dtype=np.int64)),
            "documents": [int(docs[0]), int(docs[-1]) + 1, len(docs)] if len(docs) else [],
            "num_samples": self.num_samples,
            "index_split": self.split_name,
            "random_seed": self.config.seed,
            "sequence_length": self.config.seq_length,
            "add_extra_token": self.config.add_extra_token,
            "drop_last_partial_sequence": self.drop_last,
        }

    def _cache_paths(self) -> dict | None:
        if self.prefix is None:
            return None
        cache_dir = self.config.cache_dir or default_index_cache_dir(self.prefix)
        base = os.path.join(cache_dir, f"{self.description_hash}-{type(self).__name__}-"
                                       f"{self.split_name}")
        return {name: f"{base}-{name}.npy"
                for name in ("document_index", "sample_index", "shuffle_index")} | {
            "description": f"{base}-description.json"}

    def _load_or_build(self):
        paths = self.cache_paths
        if paths and all(os.path.isfile(p) for p in paths.values()):
            logger.info("loading %s %s indices from %s", type(self).__name__, self.split_name,
                        os.path.dirname(paths["description"]))
            return tuple(np.load(paths[name], mmap_mode="r") for name in
                         ("document_index", "sample_index", "shuffle_index"))
        start = time.time()
        bar = index_progress(f"{self.split_name} indices", 4 if paths else 3)

        def step(name: str) -> None:   # ``name``: the index just built
            bar.update(1)
            bar.set_postfix_str(name, refresh=False)

        arrays = build_gpt_indices(self.indexed.sequence_lengths, self.documents,
                                   self.config.seq_length, self.num_samples, self.config.seed,
                                   self.drop_last, self.config.add_extra_token, progress=step)
        self.built_anew = True
        logger.info("built %s %s indices: %d samples, %d epochs' documents, in %.2fs",
                    type(self).__name__, self.split_name, arrays[1].shape[0] - 1,
                    len(arrays[0]) // max(len(self.documents), 1), time.time() - start)
        if paths:
            save_atomically(paths, dict(zip(("document_index", "sample_index",
                                             "shuffle_index"), arrays)), self.description)
            step("saved")
        bar.close()
        return arrays

    # -- items --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _sample_parts(self, idx: int) -> list[tuple[int, int, np.ndarray]]:
        """[(document, offset in it, tokens)] that make up sample ``idx``."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        extra = int(self.config.add_extra_token)
        i = int(self.shuffle_index[idx])
        doc_beg, off_beg = (int(x) for x in self.sample_index[i])
        doc_end, off_end = (int(x) for x in self.sample_index[i + 1])
        if doc_beg == doc_end:
            doc = int(self.document_index[doc_beg])
            return [(doc, off_beg, self.indexed.get(doc, off_beg, off_end - off_beg + extra))]
        parts = []
        for k in range(doc_beg, doc_end + 1):
            doc = int(self.document_index[k])
            offset = off_beg if k == doc_beg else 0
            length = None if k < doc_end else off_end + extra
            parts.append((doc, offset, self.indexed.get(doc, offset, length)))
        return parts

    def sample_tokens(self, idx: int) -> tuple[np.ndarray, int]:
        """(int64 [seq_length + 1] tokens of sample ``idx``, how many are real (not pad)).

        With ``config.vocab_size`` set, every id is checked to lie in ``[0, vocab_size)``
        (one max and one min per sample): :class:`TokenIdError` names the document."""
        parts = self._sample_parts(idx)
        text = np.concatenate([p for _, _, p in parts]).astype(np.int64)
        vocab = self.config.vocab_size
        if vocab is not None and len(text) and (text.max() >= vocab or text.min() < 0):
            raise self._token_id_error(idx, parts, vocab)
        real = len(text)
        want = self.config.seq_length + int(self.config.add_extra_token)
        if real < want:
            text = np.concatenate([text, np.full(want - real, self.config.pad, np.int64)])
        return text, real

    def _token_id_error(self, idx: int, parts, vocab: int) -> TokenIdError:
        for doc, offset, tokens in parts:
            bad = np.flatnonzero((tokens >= vocab) | (tokens < 0))
            if len(bad):
                pos = int(bad[0])
                where = self.prefix if self.prefix is not None else "mock data"
                return TokenIdError(
                    f"{where}: document {doc} holds token id {int(tokens[pos])} at position "
                    f"{offset + pos}, outside the vocabulary of {vocab} ids (sample {idx} of "
                    f"the {self.split_name} split); the .bin is damaged or was written with "
                    "another tokenizer: re-run tools/preprocess_data.py with the training "
                    "tokenizer")
        raise AssertionError("no out-of-vocabulary id found")  # unreachable

    def __getitem__(self, idx: int) -> dict:
        text, real = self.sample_tokens(idx)
        return make_item(text, real, self.config)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.cache_paths and not self.built_anew:  # reload the mmapped caches, don't copy
            for name in ("document_index", "sample_index", "shuffle_index"):
                state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.document_index is None:
            for name in ("document_index", "sample_index", "shuffle_index"):
                setattr(self, name, np.load(self.cache_paths[name], mmap_mode="r"))


def save_atomically(paths: dict, arrays: dict, description: dict) -> None:
    """Write each array to a temporary file and rename it; the description goes last."""
    os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    for name, array in arrays.items():
        with open(paths[name] + suffix, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(paths[name] + suffix, paths[name])
    with open(paths["description"] + suffix, "w") as f:
        json.dump(description, f, indent=2)
    os.replace(paths["description"] + suffix, paths["description"])


def make_item(text: np.ndarray, real: int, config: GPTDatasetConfig) -> dict:
    """The training item of one sample: ``text`` int64 [s + 1], the first ``real`` not pad."""
    s = config.seq_length
    tokens = text[:s].copy()
    loss_mask = np.ones(s, dtype=np.float32)
    if config.add_extra_token:
        labels = text[1:s + 1].copy()
    else:  # the last position has no next token
        labels = np.append(text[1:s], config.pad)
        loss_mask[-1] = 0.0
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod] = 0.0
    if real < len(text):  # label j is text[j + 1]: padding from j = real - 1 on
        loss_mask[max(real - 1, 0):] = 0.0
    positions = np.arange(s, dtype=np.int64)
    is_eod = tokens == config.eod
    if config.reset_position_ids:
        doc_start = np.zeros(s, dtype=np.int64)
        doc_start[1:] = np.where(is_eod[:-1], positions[1:], 0)
        positions = positions - np.maximum.accumulate(doc_start)
    item = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(positions),
    }
    if config.reset_attention_mask:
        doc_id = np.cumsum(is_eod) - is_eod  # eods before each position
        allowed = np.tril(doc_id[:, None] == doc_id[None, :])
        item["attention_mask"] = torch.from_numpy(~allowed[None])
    return item


# ----------------------------------------------------------------------------------------
# Mock data
# ----------------------------------------------------------------------------------------
class MockLowLevelDataset:
    """Megatron's synthetic documents: 100000 of them, lengths uniform in [1, 4096) drawn
    with ``numpy.random.default_rng(0)``; document i is ``1, 2, ..., len - 1, eod``.

    When ``vocab_size`` is too small for ids up to 4094 they wrap to stay below
    ``vocab_size - 1`` (identical to Megatron's otherwise).
    """

    size = 100000
    max_sequence_length = 4096

    def __init__(self, eod: int, vocab_size: int | None = None) -> None:
        self.eod = eod
        rng = np.random.default_rng(seed=0)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size,
                                             dtype=np.int32)
        self.wrap = (vocab_size - 2 if vocab_size is not None
                     and vocab_size - 2 < self.max_sequence_length - 2 else None)
        if self.wrap is not None and self.wrap < 1:
            raise ValueError(f"vocab_size {vocab_size} is too small for mock data")

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[idx])
        ids = np.arange(n - 1, dtype=np.int64)
        ids = (ids % self.wrap if self.wrap is not None else ids) + 1
        doc = np.concatenate([ids, [self.eod]])
        if length is None:
            length = n - offset
        return doc[offset:offset + length]


class MockGPTDataset(GPTDataset):
    """A GPTDataset over :class:`MockLowLevelDataset` (``--mock-data``); never cached."""

    def __init__(self, documents: np.ndarray, num_samples: int | None, split_name: str,
                 config: GPTDatasetConfig) -> None:
        super().__init__(MockLowLevelDataset(config.eod, config.vocab_size), None, documents,
                         num_samples, split_name, config)
