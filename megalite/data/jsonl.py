"""Reading raw text inputs: JSONL (one JSON object per line) or plain text, gzipped or not."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from typing import BinaryIO


def open_binary(path: str) -> BinaryIO:
    """Open ``path`` for reading bytes, transparently decompressing ``.gz`` files."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_lines(path: str) -> Iterator[bytes]:
    """The lines of ``path`` as bytes, without their line ending."""
    with open_binary(path) as f:
        for line in f:
            yield line.rstrip(b"\r\n")


def is_jsonl(path: str) -> bool:
    name = path.removesuffix(".gz")
    return name.endswith((".jsonl", ".json", ".ndjson"))


def iter_texts(path: str, json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Document texts of a JSONL file (each key of each line) or lines of a text file.

    Lenient: lines that are not valid UTF-8 / JSON objects, or lack a key, are skipped
    (``tools/preprocess_data.py`` is the strict reader that reports them).
    """
    jsonl = is_jsonl(path)
    for raw in iter_lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not jsonl:
            if line.strip():
                yield line
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in json_keys:
            value = obj.get(key)
            if isinstance(value, str) and value:
                yield value
