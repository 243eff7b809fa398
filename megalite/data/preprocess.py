"""Tokenizing a JSONL corpus into ``.bin/.idx`` datasets (the engine of
``tools/preprocess_data.py``; see that script for the command line).

Each input line is one JSON object; its documents (one per ``json_keys`` key) are written, or
the whole line is skipped and counted: blank lines, invalid UTF-8, malformed JSON, a
non-object, a missing key, a value that is not text, an empty document. With ``strict`` the
first skipped line raises :class:`PreprocessError` naming its line number; a run that
finds no document at all raises it too (with the skipped lines counted by reason). Outputs are
written under temporary names and renamed only at the end, so a failed or interrupted run
leaves nothing that looks like a dataset. Worker processes tokenize chunks of lines
(``multiprocessing.Pool.imap``, input order kept).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from megalite.data.indexed_dataset import (
    IndexedDatasetWriter,
    bin_path,
    idx_path,
    merge_datasets,
    optimal_dtype,
)
from megalite.data.jsonl import open_binary
from megalite.data.tokenizers import TokenizerError, create_tokenizer
from megalite.errors import DataError

CHUNK_BYTES = 256 << 10  # input handed to a worker at a time
CHUNK_LINES = 512


@dataclass
class PreprocessOptions:
    """The settings of one run (``tools/preprocess_data.py`` flags, underscored)."""

    input: str
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: list | None = None
    json_keys: list = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    workers: int = 1
    partitions: int = 1
    log_interval: int = 1000  # docs between MB/s refreshes of the progress bar; 0: no bar
    strict: bool = False


class PreprocessError(DataError, RuntimeError):
    """A fatal problem with the input or the flags (reported as one line, exit code 1)."""


def tokenizer_spec(args: PreprocessOptions) -> dict:
    return {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
            "vocab_file": args.vocab_file, "merge_file": args.merge_file,
            "vocab_size": args.vocab_size, "tiktoken_pattern": args.tiktoken_pattern,
            "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
            "tiktoken_special_tokens": args.tiktoken_special_tokens}


# ----------------------------------------------------------------------------------------
# Encoding (runs in the worker processes)
# ----------------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])(\s+)")


def split_sentences(text: str, keep_newlines: bool) -> list[str]:
    """Split after . ! ? followed by whitespace (a light stand-in for nltk's punkt)."""
    pieces = _SENTENCE_END.split(text)
    out = []
    for i in range(0, len(pieces), 2):
        sentence = pieces[i]
        if keep_newlines and i + 1 < len(pieces):
            sentence += "\n" * pieces[i + 1].count("\n")
        if sentence.strip():
            out.append(sentence)
    return out


class Encoder:
    """Turns raw input lines into token arrays; one instance per worker process."""

    def __init__(self, spec: dict, json_keys, split: bool, keep_newlines: bool,
                 append_eod: bool) -> None:
        self.tokenizer = create_tokenizer(**spec)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.json_keys, self.split, self.keep_newlines = json_keys, split, keep_newlines
        self.append_eod = append_eod

    def encode_line(self, raw: bytes):
        """``("ok", {key: (tokens [n], sentence lengths)})``, ``("blank", None)`` or
        ``("skip", (reason, detail))``."""
        if not raw.strip():
            return "blank", None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return "skip", ("invalid UTF-8", f"byte {e.start}: {raw[e.start:e.start + 4]!r}")
        try:
            obj = json.loads(line)
        except ValueError as e:
            return "skip", ("malformed JSON", str(e))
        if not isinstance(obj, dict):
            return "skip", ("not a JSON object", type(obj).__name__)
        docs = {}
        for key in self.json_keys:
            if key not in obj:
                return "skip", (f"missing key {key!r}", "")
            value = obj[key]
            if isinstance(value, str):
                sentences = split_sentences(value, self.keep_newlines) if self.split else [value]
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                sentences = value
            else:
                return "skip", (f"key {key!r} is not text", type(value).__name__)
            ids, lengths = [], []
            try:
                for sentence in sentences:
                    if not sentence.strip():  # whitespace alone is not a document
                        continue
                    tokens = self.tokenizer.tokenize(sentence)
                    if tokens:
                        ids.extend(tokens)
                        lengths.append(len(tokens))
            except Exception as e:  # noqa: BLE001 (tokenizer libraries raise assorted types)
                return "skip", ("tokenizer error", f"{type(e).__name__}: {e}")
            if not ids:
                return "skip", (f"empty document in key {key!r}", "")
            if self.append_eod:
                ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            docs[key] = (np.asarray(ids, dtype=self.dtype), lengths)
        return "ok", docs

    def encode_chunk(self, chunk):
        """[(line number, raw bytes)] -> [(line number, bytes, status, payload)]."""
        return [(n, len(raw) + 1, *self.encode_line(raw)) for n, raw in chunk]


_encoder: Encoder | None = None


_PARENT_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _init_worker(*encoder_args) -> None:
    """A worker's start. It was forked with SIGINT/SIGTERM blocked (see :func:`_run_pool`):
    had the parent's SIGTERM handler (tools/preprocess_data.py turns SIGTERM into a
    KeyboardInterrupt) been live in the child before this ran, a ``Pool.terminate()`` right
    after start-up could be swallowed and the parent would wait for the worker forever."""
    global _encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled (once) by the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pool.terminate() must just end us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PARENT_SIGNALS)  # a pending one ends us now
    _encoder = Encoder(*encoder_args)


def _encode_chunk(chunk):
    return _encoder.encode_chunk(chunk)


# ----------------------------------------------------------------------------------------
# Driving (main process)
# ----------------------------------------------------------------------------------------
def read_chunks(path: str, boundaries: list[int]):
    """Yield ``(part, [(line number, raw)])``; chunks never straddle a partition boundary.

    ``boundaries`` are the first line numbers (1-based) of parts 1..P-1.
    """
    part, chunk, size = 0, [], 0
    try:
        with open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                while part < len(boundaries) and number >= boundaries[part]:
                    if chunk:
                        yield part, chunk
                        chunk, size = [], 0
                    part += 1
                chunk.append((number, raw.rstrip(b"\r\n")))
                size += len(raw)
                if size >= CHUNK_BYTES or len(chunk) >= CHUNK_LINES:
                    yield part, chunk
                    chunk, size = [], 0
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise PreprocessError(f"{path}: cannot read the input ({e})") from None
    if chunk:
        yield part, chunk


def count_lines(path: str) -> int:
    try:
        with open_binary(path) as f:
            return sum(1 for _ in f)
    except (OSError, EOFError) as e:
        raise PreprocessError(f"{path}: cannot read the input ({e})") from None


class Stats:
    """Counts of one run: documents, lines, bytes, tokens per key, skipped and blank lines."""

    def __init__(self, keys) -> None:
        self.docs = 0
        self.lines = 0
        self.bytes = 0
        self.tokens = Counter({key: 0 for key in keys})
        self.skipped = Counter()
        self.skipped_lines = defaultdict(list)
        self.blank = 0
        self.start = time.time()

    def rates(self) -> tuple[float, float]:
        elapsed = max(time.time() - self.start, 1e-9)
        return self.docs / elapsed, self.bytes / elapsed / 1e6

    def add_chunk(self, encoded, writers: dict, strict_input: str | None) -> int:
        """Write the chunk's documents and count every line; returns the new documents.

        ``strict_input``: the input's path under ``--strict`` (the first skipped line
        raises :class:`PreprocessError`), else None (skipped lines are counted, the line
        numbers of the first five kept per reason).
        """
        docs_before = self.docs
        for number, nbytes, status, payload in encoded:
            self.lines += 1
            self.bytes += nbytes
            if status == "ok":
                for key, (tokens, lengths) in payload.items():
                    writers[key].add_document(tokens, lengths)
                    self.tokens[key] += len(tokens)
                self.docs += 1
            elif status == "blank":
                self.blank += 1
            else:
                self._skip(number, *payload, strict_input)
        return self.docs - docs_before

    def _skip(self, number: int, reason: str, detail: str, strict_input: str | None) -> None:
        if strict_input is not None:
            raise PreprocessError(
                f"{strict_input}: line {number}: {reason}"
                f"{f' ({detail})' if detail else ''}; stopping (--strict), no output written")
        self.skipped[reason] += 1
        if len(self.skipped_lines[reason]) < 5:
            self.skipped_lines[reason].append(number)

    def summary(self, outputs: dict, dtype) -> dict:
        docs_per_s, mb_per_s = self.rates()
        return {"documents": self.docs, "lines": self.lines, "bytes": self.bytes,
                "tokens": dict(self.tokens), "skipped": dict(self.skipped),
                "skipped_lines": dict(self.skipped_lines), "blank_lines": self.blank,
                "seconds": time.time() - self.start, "docs_per_s": docs_per_s,
                "mb_per_s": mb_per_s, "outputs": outputs, "dtype": dtype.name}


def _run_pool(args, encoder_args, chunks):
    """Yield encoded chunks in input order, from worker processes or in-process."""
    if args.workers == 1:
        encoder = Encoder(*encoder_args)
        for part, chunk in chunks:
            yield part, encoder.encode_chunk(chunk)
        return
    import multiprocessing

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are the parallelism
    parts: list[int] = []
    slots = threading.Semaphore(4 * args.workers)  # bound the chunks in flight
    stop = threading.Event()

    def gated():
        for part, chunk in chunks:
            slots.acquire()
            if stop.is_set():
                return
            parts.append(part)
            yield chunk

    # workers start with the signals blocked until _init_worker has reset their handlers, and
    # an interrupt while the pool is being built is held until ``pool`` names it
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENT_SIGNALS)
    try:
        with _interrupts_held():
            pool = multiprocessing.Pool(args.workers, _init_worker, encoder_args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        _raise_if_interrupted()
        for i, encoded in enumerate(pool.imap(_encode_chunk, gated())):
            slots.release()
            yield parts[i], encoded
        pool.close()
    except BaseException:
        stop.set()
        slots.release()
        _drain(pool)
        raise
    finally:
        pool.join()


def _drain(pool) -> None:
    """Stop ``pool`` after an error or interrupt: no new chunks are handed out (the caller
    stopped the feed), the workers finish the few in flight (at most ``4 x workers``
    chunks) and exit. ``Pool.terminate()`` is kept for a second interrupt only: it kills
    workers that may be writing a result, and one killed while holding the result queue's
    lock leaves the pool's task thread, and so this process, waiting forever."""
    pool.close()
    try:
        pool.join()
    except BaseException:
        pool.terminate()
        raise


# ----------------------------------------------------------------------------------------
# interrupts: SIGINT / SIGTERM end a run with nothing written

_interrupt = threading.Event()   # set by the handler, read by the main loop
_hold = threading.local()        # >0 while the handler must not raise in this thread


def interrupt_handler(signum, frame) -> None:
    """The handler ``tools/preprocess_data.py`` installs for SIGINT and SIGTERM: raise
    KeyboardInterrupt, which unwinds through the cleanup that deletes partial outputs. The
    request is also recorded, because Python runs a handler between any two bytecodes of the
    main thread, a ``__del__`` or weakref callback included, where the exception is printed
    and dropped: the main loop raises it again after each chunk and before the outputs are
    renamed into place."""
    _interrupt.set()
    if not getattr(_hold, "depth", 0):
        raise KeyboardInterrupt


class _interrupts_held:
    """While inside, an interrupt is recorded but not raised (``multiprocessing.Pool``'s
    start-up must not stop half way); the caller raises it afterwards with
    :func:`_raise_if_interrupted`."""

    def __enter__(self):
        _hold.depth = getattr(_hold, "depth", 0) + 1

    def __exit__(self, *exc):
        _hold.depth -= 1


def _raise_if_interrupted() -> None:
    if _interrupt.is_set():
        raise KeyboardInterrupt


def preprocess(args: PreprocessOptions) -> dict:
    """Run the conversion; returns the summary numbers. Raises PreprocessError, and
    KeyboardInterrupt after :func:`interrupt_handler` ran (nothing written either way)."""
    _interrupt.clear()
    dtype = optimal_dtype(_load_tokenizer(args).vocab_size)
    check_output_dir(args.output_prefix)
    chunks = read_chunks(args.input, partition_boundaries(args))
    outputs = PartitionedOutputs(args, dtype)
    stats = Stats(args.json_keys)
    progress = Progress(args.log_interval)
    encoder_args = (tokenizer_spec(args), args.json_keys, args.split_sentences,
                    args.keep_newlines, args.append_eod)
    encoded_chunks = _run_pool(args, encoder_args, chunks)
    try:
        for part, encoded in encoded_chunks:
            _raise_if_interrupted()
            new_docs = stats.add_chunk(encoded, outputs.writers_for(part),
                                       args.input if args.strict else None)
            progress.advance(new_docs, stats)
        _raise_if_interrupted()
        if stats.docs == 0:  # an empty dataset is no success: write nothing, say why
            raise PreprocessError(f"{args.input}: no documents to write "
                                  f"({nothing_written(stats)}); no output written")
        outputs.finish()
    except BaseException:
        encoded_chunks.close()  # stops the worker pool now, not when garbage collected
        outputs.abort()
        raise
    finally:
        progress.close()
    return stats.summary(outputs.final, dtype)


def nothing_written(stats: Stats) -> str:
    """Why a run found no documents: its lines, blank ones, and skipped ones by reason."""
    if stats.lines == 0:
        return "the input is empty"
    parts = [f"{stats.lines} line{'s' if stats.lines != 1 else ''} read"]
    if stats.blank:
        parts.append(f"{stats.blank} blank")
    for reason, n in sorted(stats.skipped.items(), key=lambda kv: -kv[1]):
        first = ", ".join(str(x) for x in stats.skipped_lines[reason])
        parts.append(f"{n} x {reason} (line{'s' if n > 1 else ''} {first}"
                     f"{', ...' if n > 5 else ''})")
    return ", ".join(parts)


def check_output_dir(prefix: str) -> None:
    """The directory of ``--output-prefix`` exists (is created) and takes a file; else one
    PreprocessError naming it, before any tokenizing."""
    import tempfile

    directory = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise PreprocessError(f"--output-prefix {prefix}: cannot write to the directory "
                              f"{directory} ({e.strerror or e}); choose a writable "
                              "location") from None


def _load_tokenizer(args: PreprocessOptions):
    if not os.path.isfile(args.input):
        raise PreprocessError(f"{args.input}: input file not found")
    try:
        return create_tokenizer(**tokenizer_spec(args))
    except TokenizerError as e:
        raise PreprocessError(str(e)) from None


def partition_boundaries(args: PreprocessOptions) -> list[int]:
    """First line numbers (1-based) of partitions 1..P-1: equal shares of the input lines."""
    if args.partitions <= 1:
        return []
    total = count_lines(args.input)
    return [1 + total * p // args.partitions for p in range(1, args.partitions)]


class PartitionedOutputs:
    """The writers of the partition being filled, and the datasets written so far.

    With ``partitions == 1`` each key is written straight to its final prefix; otherwise
    to ``<final>.part<p>-of-<P>`` files that :meth:`finish` merges and removes.
    """

    def __init__(self, args: PreprocessOptions, dtype) -> None:
        level = "sentence" if args.split_sentences else "document"
        self.keys = list(args.json_keys)
        self.final = {key: f"{args.output_prefix}_{key}_{level}" for key in self.keys}
        self.partitions = args.partitions
        self.dtype = dtype
        self.writers: dict = {}
        self.written: list[str] = []
        self.part = -1

    def prefix(self, key: str, part: int) -> str:
        if self.partitions == 1:
            return self.final[key]
        return f"{self.final[key]}.part{part}-of-{self.partitions}"

    def writers_for(self, part: int) -> dict:
        """{key: writer} of ``part``; the previous partition's writers are finalized."""
        if part != self.part:
            for writer in self.writers.values():
                writer.finalize()
            self._open(part)
        return self.writers

    def _open(self, part: int) -> None:
        self.writers = {key: IndexedDatasetWriter(self.prefix(key, part), self.dtype)
                        for key in self.keys}
        self.written.extend(self.prefix(key, part) for key in self.keys)
        self.part = part

    def finish(self) -> None:
        """Finalize the last partition and merge the partitions into the final outputs."""
        if not self.writers:
            self._open(0)
        for writer in self.writers.values():
            writer.finalize()
        if self.partitions > 1:
            for key in self.keys:
                parts = [self.prefix(key, p) for p in range(self.partitions)
                         if self.prefix(key, p) in self.written]
                merge_datasets(parts, self.final[key])
            _remove_datasets(self.written)

    def abort(self) -> None:
        """Drop the open writers' temporary files and every partition written."""
        for writer in self.writers.values():
            writer.abort()
        if self.partitions > 1:
            _remove_datasets(self.written)


class Progress:
    """A tqdm bar of documents on stderr with the MB/s rate refreshed every
    ``log_interval`` documents; nothing at all with ``log_interval == 0``."""

    def __init__(self, log_interval: int) -> None:
        self.log_interval = log_interval
        self.last_log = 0
        self.bar = None
        if log_interval > 0:
            from tqdm import tqdm

            self.bar = tqdm(unit=" docs", desc="preprocess", file=sys.stderr,
                            mininterval=0.5, dynamic_ncols=True)

    def advance(self, new_docs: int, stats: Stats) -> None:
        if self.bar is None:
            return
        self.bar.update(new_docs)
        if stats.docs - self.last_log >= self.log_interval:
            self.last_log = stats.docs
            self.bar.set_postfix_str(f"{stats.rates()[1]:.2f} MB/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _remove_datasets(prefixes) -> None:
    for prefix in prefixes:
        for path in (bin_path(prefix), idx_path(prefix)):
            if os.path.exists(path):
                os.remove(path)


def format_summary(s: dict) -> str:
    tokens = ", ".join(f"{n} {key} tokens" for key, n in s["tokens"].items())
    lines = [(f"done: {s['documents']} documents, {tokens} ({s['dtype']}) from "
              f"{s['bytes'] / 1e6:.2f} MB in {s['seconds']:.1f}s "
              f"({s['docs_per_s']:.0f} docs/s, {s['mb_per_s']:.2f} MB/s)")]
    skipped = sum(s["skipped"].values())
    if skipped:
        lines.append(f"skipped {skipped} lines:")
        for reason, n in sorted(s["skipped"].items(), key=lambda kv: -kv[1]):
            first = ", ".join(str(x) for x in s["skipped_lines"][reason])
            where = f"line{'s' if n > 1 else ''} {first}{', ...' if n > 5 else ''}"
            lines.append(f"  {n} x {reason} ({where})")
    if s["blank_lines"]:
        lines.append(f"ignored {s['blank_lines']} blank lines")
    for prefix in s["outputs"].values():
        lines.append(f"wrote {prefix}.bin and {prefix}.idx")
    return "\n".join(lines)


