"""The ``.bin/.idx`` token store, byte-compatible with Megatron-Core's indexed dataset.

A dataset is a pair of files sharing a prefix. ``PREFIX.bin`` holds the token ids of every
sequence back to back. ``PREFIX.idx`` describes them (all integers little-endian)::

    offset  size       field
    0       9          magic b"MMIDIDX\\x00\\x00"
    9       uint64     version, always 1
    17      uint8      dtype code of the .bin tokens (see DTYPE_CODES)
    18      uint64     S, the number of sequences
    26      uint64     D, the number of entries of the document index (documents + 1)
    34      int32[S]   sequence lengths, in tokens
            int64[S]   byte offset of each sequence in the .bin
            int64[D]   document index: the sequence where each document starts, 0 first and
                       S last (so document d is sequences [doc[d], doc[d+1]))
            (int8[S]   sequence modes, only in Megatron's multimodal datasets; tolerated)

Without sentence splitting a document is one sequence. The reader memory-maps both files
(or, with ``mmap=False`` / ``--no-mmap-bin-files``, reads the ``.bin`` with plain positioned
reads; the tokens are the same) and checks the header and both file sizes first, so a
truncated or foreign file fails with one message naming the file and the problem instead of
returning garbage.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from megalite.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 sequence count + 8 document count

# dtype code byte <-> numpy dtype (Megatron-Core's DType enum values).
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}


class IndexedDatasetError(DataError, ValueError):
    """A ``.bin``/``.idx`` file that is missing, truncated or not in the expected format."""


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def exists(prefix: str) -> bool:
    """Whether both files of the dataset at ``prefix`` exist."""
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Token dtype for a vocabulary: uint16 below 65500 ids, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------
class IndexedDataset:
    """Memory-mapped reader of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``mmap=False`` reads the ``.bin`` with ``os.pread`` per request instead of mapping it
    (Megatron's ``--no-mmap-bin-files``: for file systems where mmap is slow); the index is
    mapped either way.

    Attributes (numpy views into the mmapped index):
        sequence_lengths:  int32 [S]   tokens per sequence
        sequence_pointers: int64 [S]   byte offset of each sequence in the .bin
        document_indices:  int64 [D+1] first sequence of each document, then S
        dtype:             token dtype of the .bin

    ``ds[i]`` is sequence i as a read-only numpy array of ``dtype``;
    ``ds.get(i, offset, length)`` a slice of it; ``ds.document(d)`` the tokens of document d.
    Pickles as its prefix, so DataLoader workers reopen the files.
    """

    def __init__(self, prefix: str, verify_pointers: bool = False, mmap: bool = True) -> None:
        self.prefix = prefix
        self.mmap = mmap
        self._open(verify_pointers)

    # -- construction -------------------------------------------------------------------
    def _open(self, verify_pointers: bool) -> None:
        ipath, bpath = idx_path(self.prefix), bin_path(self.prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (an indexed dataset needs "
                                          f"both {os.path.basename(ipath)} and "
                                          f"{os.path.basename(bpath)})")
        idx_size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise IndexedDatasetError(f"{ipath}: truncated header ({len(header)} bytes, "
                                      f"expected at least {HEADER_BYTES})")
        magic, version, code, num_seq, num_doc_entries = struct.unpack("<9sQBQQ", header)
        if magic != MAGIC:
            raise IndexedDatasetError(f"{ipath}: bad magic {magic!r}, expected {MAGIC!r} "
                                      "(not a Megatron indexed dataset index)")
        if version != VERSION:
            raise IndexedDatasetError(f"{ipath}: unsupported version {version}, expected "
                                      f"{VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{ipath}: unknown dtype code {code} (valid: "
                                      f"{sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        body = num_seq * (4 + 8) + num_doc_entries * 8
        if idx_size not in (HEADER_BYTES + body, HEADER_BYTES + body + num_seq):
            raise IndexedDatasetError(
                f"{ipath}: size is {idx_size} bytes but the header ({num_seq} sequences, "
                f"{num_doc_entries} document entries) needs {HEADER_BYTES + body}; the file "
                "is truncated or corrupt")
        self._idx_mmap = np.memmap(ipath, mode="r", dtype=np.uint8)
        buf = self._idx_mmap
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, num_seq, off)
        off += 4 * num_seq
        self.sequence_pointers = np.frombuffer(buf, np.int64, num_seq, off)
        off += 8 * num_seq
        self.document_indices = np.frombuffer(buf, np.int64, num_doc_entries, off)
        self._check_index(ipath, verify_pointers)

        expected_bin = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1])
                        * self.dtype.itemsize) if num_seq else 0
        bin_size = os.path.getsize(bpath)
        if bin_size != expected_bin:
            raise IndexedDatasetError(
                f"{bpath}: size is {bin_size} bytes but {os.path.basename(ipath)} describes "
                f"{expected_bin} bytes of {self.dtype.name} tokens; the .bin is "
                f"{'truncated' if bin_size < expected_bin else 'too long'} or belongs to "
                "another index")
        self._bin = self._bin_file = None
        if bin_size and self.mmap:
            self._bin = np.memmap(bpath, mode="r", dtype=np.uint8)
        elif bin_size:
            self._bin_file = open(bpath, "rb", buffering=0)  # noqa: SIM115 (lives with self)

    def _check_index(self, ipath: str, verify_pointers: bool) -> None:
        docs, lengths = self.document_indices, self.sequence_lengths
        num_seq = len(lengths)
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != num_seq:
            raise IndexedDatasetError(
                f"{ipath}: document index must start at 0 and end at the sequence count "
                f"{num_seq}, got {docs[:1].tolist()}...{docs[-1:].tolist()}")
        if len(docs) > 1 and np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{ipath}: document index is not non-decreasing")
        if num_seq and lengths.min() < 0:
            raise IndexedDatasetError(f"{ipath}: negative sequence length")
        if verify_pointers and num_seq:
            expected = np.zeros(num_seq, dtype=np.int64)
            np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
            expected *= self.dtype.itemsize
            bad = np.flatnonzero(expected != self.sequence_pointers)
            if len(bad):
                raise IndexedDatasetError(
                    f"{ipath}: sequence {bad[0]} points at byte {self.sequence_pointers[bad[0]]}"
                    f", expected {expected[bad[0]]} (sequences must be stored back to back)")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix, "mmap": self.mmap}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self.mmap = state.get("mmap", True)
        self._open(verify_pointers=False)

    def _tokens(self, start: int, count: int) -> np.ndarray:
        """``count`` tokens from byte ``start`` of the .bin (read-only array)."""
        if count == 0:
            return np.zeros(0, dtype=self.dtype)
        if self._bin is not None:
            return np.frombuffer(self._bin, self.dtype, count, start)
        nbytes = count * self.dtype.itemsize
        data = os.pread(self._bin_file.fileno(), nbytes, start)
        if len(data) != nbytes:
            raise IndexedDatasetError(f"{bin_path(self.prefix)}: short read at byte {start} "
                                      f"({len(data)} of {nbytes} bytes); the file changed")
        return np.frombuffer(data, self.dtype)

    # -- access -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` ([length] of ``dtype``)."""
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"{bin_path(self.prefix)}: tokens [{offset}, {offset + length}) "
                             f"out of range for sequence {idx} of length {seq_len}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._tokens(start, length)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        return self.get(idx % len(self))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated)."""
        first, last = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first])
        count = int(self.sequence_lengths[first:last].sum(dtype=np.int64))
        return self._tokens(start, count)


# ----------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------
def write_index(path: str, dtype: np.dtype, sequence_lengths: Sequence[int] | np.ndarray,
                document_indices: Sequence[int] | np.ndarray) -> None:
    """Write a ``.idx`` for sequences stored back to back in ``dtype`` (pointers derived)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    docs = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    with open(path, "wb") as f:
        f.write(struct.pack("<9sQBQQ", MAGIC, VERSION, CODE_OF_DTYPE[dtype], len(lengths),
                            len(docs)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(docs.tobytes())


class IndexedDatasetWriter:
    """Builds ``PREFIX.bin``/``PREFIX.idx`` atomically.

    Everything is written to ``PREFIX.bin.tmp-<pid>``/``.idx.tmp-<pid>`` and renamed into place
    by :meth:`finalize`; :meth:`abort` (or leaving a ``with`` block by an exception) deletes
    the temporaries, so an interrupted run never leaves files that look valid::

        with IndexedDatasetWriter(prefix, np.uint16) as out:
            out.add_document(tokens)              # one sequence
            out.add_document(tokens, [3, 5])      # two sequences (sentences) of 3 and 5 tokens
    """

    def __init__(self, prefix: str, dtype=np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp, self._idx_tmp = bin_path(prefix) + suffix, idx_path(prefix) + suffix
        parent = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin_file = open(self._bin_tmp, "wb")  # noqa: SIM115 (closed by finalize/abort)
        self._lengths = array("i")
        self._docs = array("q", [0])
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        self._done = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    @property
    def num_documents(self) -> int:
        return len(self._docs) - 1

    def _write_tokens(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if self._info is not None and arr.size and (arr.min() < self._info.min
                                                    or arr.max() > self._info.max):
            raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit "
                             f"{self.dtype.name}; pick a wider dtype")
        self._bin_file.write(arr.astype(self.dtype, copy=False).tobytes())
        return arr.size

    def add_item(self, tokens) -> None:
        """Append one sequence to the current document (close it with end_document)."""
        self._lengths.append(self._write_tokens(tokens))

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens, lengths: Iterable[int] | None = None) -> None:
        """Append a document: ``tokens`` [n], split into sequences of ``lengths`` (sum n)."""
        n = self._write_tokens(tokens)
        lengths = [n] if lengths is None else list(lengths)
        if sum(lengths) != n:
            raise ValueError(f"sequence lengths {lengths} do not add up to {n} tokens")
        self._lengths.extend(lengths)
        self._docs.append(len(self._lengths))

    def add_index(self, prefix: str) -> None:
        """Append every document of the dataset at ``prefix`` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{idx_path(prefix)}: token dtype {other.dtype.name} "
                                      f"differs from the output's {self.dtype.name}; cannot "
                                      "merge")
        base = len(self._lengths)
        self._lengths.frombytes(np.ascontiguousarray(other.sequence_lengths).tobytes())
        self._docs.frombytes((other.document_indices[1:] + base).tobytes())
        del other
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin_file, 16 << 20)

    def finalize(self) -> None:
        """Write the index and move both files into place (.bin first, then .idx)."""
        if self._done:
            return
        try:
            self._bin_file.close()
            write_index(self._idx_tmp, self.dtype, np.frombuffer(self._lengths, np.int32),
                        np.frombuffer(self._docs, np.int64))
            os.replace(self._bin_tmp, bin_path(self.prefix))
            os.replace(self._idx_tmp, idx_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Discard everything written so far."""
        self._done = True
        self._bin_file.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)


def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate the datasets at ``prefixes`` (in order) into ``output_prefix``."""
    if not prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as out:
        for prefix in prefixes:
            out.add_index(prefix)
    return IndexedDataset(output_prefix)
