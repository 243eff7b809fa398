"""The .bin/.idx format: round trips, the documented bytes, merging and bad files."""

from __future__ import annotations

import os
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    merge_datasets,
    optimal_dtype,
)
from tests.data.conftest import random_documents, write_dataset
from tests.tools import load_tool


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64,
                                   np.float64, np.float32, np.uint16])
def test_round_trip_every_dtype(tmp_path, rng, dtype):
    docs = [d.astype(dtype) for d in random_documents(rng, 50, 40, 100)]
    prefix = write_dataset(tmp_path / "ds", docs, dtype)
    ds = IndexedDataset(prefix, verify_pointers=True)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        np.testing.assert_array_equal(ds.document(i), doc)
    np.testing.assert_array_equal(ds.get(3, offset=2, length=5), docs[3][2:7])
    np.testing.assert_array_equal(ds.get(3, offset=4), docs[3][4:])


def test_documents_of_several_sequences(tmp_path, rng):
    prefix = str(tmp_path / "sent")
    docs = []
    with IndexedDatasetWriter(prefix, np.int32) as out:
        for _ in range(20):
            lengths = [int(n) for n in rng.integers(1, 9, size=int(rng.integers(1, 5)))]
            doc = rng.integers(0, 1 << 20, size=sum(lengths))
            out.add_document(doc, lengths)
            docs.append((doc, lengths))
        out.add_item(np.array([7, 8]))  # the add_item/end_document path
        out.add_item(np.array([9]))
        out.end_document()
    ds = IndexedDataset(prefix, verify_pointers=True)
    assert ds.num_documents == 21
    assert len(ds) == sum(len(lengths) for _, lengths in docs) + 2
    for d, (doc, lengths) in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), doc)
        first = ds.document_indices[d]
        assert ds.sequence_lengths[first:first + len(lengths)].tolist() == lengths
    np.testing.assert_array_equal(ds.document(20), [7, 8, 9])


def test_reads_bytes_written_from_the_spec(tmp_path):
    """A .bin/.idx built byte by byte from the format description, not by our writer."""
    docs = [[5, 6, 7], [65000], [1, 2], [300, 301, 302, 303]]
    lengths = [len(d) for d in docs]
    pointers = [0, 6, 8, 12]  # uint16: 2 bytes per token
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
    idx += struct.pack("<Q", 4) + struct.pack("<Q", 5)
    idx += struct.pack("<4i", *lengths) + struct.pack("<4q", *pointers)
    idx += struct.pack("<5q", 0, 1, 2, 3, 4)
    (tmp_path / "spec.idx").write_bytes(idx)
    tokens = np.array([t for d in docs for t in d], dtype="<u2")
    (tmp_path / "spec.bin").write_bytes(tokens.tobytes())
    ds = IndexedDataset(str(tmp_path / "spec"), verify_pointers=True)
    assert ds.dtype == np.uint16 and len(ds) == 4
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc


def test_writer_output_matches_the_spec_bytes(tmp_path):
    prefix = write_dataset(tmp_path / "w", [np.array([1, 2, 3]), np.array([4])], np.int32)
    idx = Path(prefix + ".idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<QBQQ", idx[9:34]) == (1, 4, 2, 3)
    assert struct.unpack("<2i2q3q", idx[34:]) == (3, 1, 0, 12, 0, 1, 2)
    assert Path(prefix + ".bin").read_bytes() == np.array([1, 2, 3, 4], "<i4").tobytes()


def test_optimal_dtype():
    assert optimal_dtype(8000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"), \
            IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as out:
        out.add_document(np.array([1, 70000]))
    assert os.listdir(tmp_path) == []  # aborted: no temporaries, no outputs


def test_merge(tmp_path, rng):
    parts = [random_documents(rng, n, 30, 1000) for n in (5, 0, 7)]
    prefixes = [write_dataset(tmp_path / f"p{i}", docs) for i, docs in enumerate(parts)]
    merged = merge_datasets(prefixes, str(tmp_path / "all"))
    flat = [d for docs in parts for d in docs]
    assert merged.num_documents == len(flat)
    for i, doc in enumerate(flat):
        np.testing.assert_array_equal(merged.document(i), doc)
    IndexedDataset(str(tmp_path / "all"), verify_pointers=True)


def test_merge_tool_and_dtype_mismatch(tmp_path, rng, capsys):
    tool = load_tool("merge_datasets")
    (tmp_path / "in").mkdir()
    write_dataset(tmp_path / "in" / "a", random_documents(rng, 3, 10, 50))
    write_dataset(tmp_path / "in" / "b", random_documents(rng, 4, 10, 50))
    assert tool.main(["--input", str(tmp_path / "in"), "--output-prefix",
                      str(tmp_path / "m")]) == 0
    assert IndexedDataset(str(tmp_path / "m")).num_documents == 7
    write_dataset(tmp_path / "c", [np.array([1])], np.int32)
    rc = tool.main(["--input", str(tmp_path / "m"), str(tmp_path / "c"), "--output-prefix",
                    str(tmp_path / "bad")])
    assert rc == 1
    assert "int32 differs from the output's uint16" in capsys.readouterr().err
    assert not any(p.name.startswith("bad") for p in tmp_path.iterdir())


def test_pickles_as_its_prefix(tmp_path, rng):
    prefix = write_dataset(tmp_path / "p", random_documents(rng, 3, 10, 50))
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert len(pickle.dumps(IndexedDataset(prefix))) < 200
    np.testing.assert_array_equal(ds[1], IndexedDataset(prefix)[1])


# -- bad files ---------------------------------------------------------------------------
@pytest.fixture
def good(tmp_path, rng):
    return write_dataset(tmp_path / "good", random_documents(rng, 10, 20, 100))


def test_truncated_bin(good):
    size = os.path.getsize(good + ".bin")
    with open(good + ".bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: size is .* truncated"):
        IndexedDataset(good)


def test_wrong_magic(good):
    data = bytearray(Path(good + ".idx").read_bytes())
    data[:9] = b"NOTMAGIC!"
    Path(good + ".idx").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: bad magic b'NOTMAGIC!'"):
        IndexedDataset(good)


def test_truncated_idx(good):
    data = Path(good + ".idx").read_bytes()
    Path(good + ".idx").write_bytes(data[:-8])
    with pytest.raises(IndexedDatasetError, match=r"good\.idx: size is .* truncated"):
        IndexedDataset(good)
    Path(good + ".idx").write_bytes(data[:20])
    with pytest.raises(IndexedDatasetError, match="truncated header"):
        IndexedDataset(good)


@pytest.mark.parametrize("offset,value,message", [(9, 2, "unsupported version 2"),
                                                  (17, 9, "unknown dtype code 9")])
def test_bad_header_fields(good, offset, value, message):
    data = bytearray(Path(good + ".idx").read_bytes())
    data[offset] = value
    Path(good + ".idx").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match=message):
        IndexedDataset(good)


def test_missing_bin(good):
    os.remove(good + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"good\.bin: file not found"):
        IndexedDataset(good)


@pytest.mark.parametrize("damage,message", [("truncate-bin", r"\.bin: size is .* truncated"),
                                            ("magic", r"\.idx: bad magic")])
def test_tools_report_damaged_inputs(tmp_path, rng, capsys, damage, message):
    """A command-line tool fed a damaged dataset prints one error and writes nothing."""
    prefix = write_dataset(tmp_path / "in", random_documents(rng, 5, 10, 50))
    if damage == "truncate-bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(3)
    else:
        Path(prefix + ".idx").write_bytes(b"XXXXXXXXX" + Path(prefix + ".idx").read_bytes()[9:])
    tool = load_tool("merge_datasets")
    assert tool.main(["--input", prefix, "--output-prefix", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.bin", "in.idx"]
