#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron-compatible ``.bin/.idx`` datasets.

    python tools/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix out/corpus \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model spm.model \\
        --append-eod --workers 2

writes ``out/corpus_text_document.bin/.idx`` (``PREFIX_{key}_document`` for each
``--json-keys`` key; ``_sentence`` with ``--split-sentences``). Each input line is one JSON
object; its documents (one per key) are written, or the whole line is skipped and counted:
blank lines, invalid UTF-8, malformed JSON, a non-object, a missing key, a value that is not
text, an empty document. The summary lists the skipped lines by reason; with ``--strict``
the first one stops the run with its line number and exit code 1. An input that gives no
document at all (empty, or every line skipped) is an error too (exit code 1, the skipped
lines counted by reason, nothing written), as is an ``--output-prefix`` directory that
cannot be written (checked before any tokenizing). Outputs are written to
temporary names and renamed only at the end, so a failed or interrupted run leaves nothing
that looks like a dataset.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.data.preprocess import (
    PreprocessError,
    PreprocessOptions,
    format_summary,
    interrupt_handler,
    preprocess,
)
from megalite.config.data import TOKENIZER_TYPES
from megalite.data.tokenizers import TIKTOKEN_PATTERNS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSONL file (.jsonl or .jsonl.gz).")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="Keys of each JSON object to tokenize (default: text).")
    g.add_argument("--split-sentences", action="store_true",
                   help="Store each sentence as its own sequence (simple punctuation rule).")
    g.add_argument("--keep-newlines", action="store_true",
                   help="With --split-sentences, keep newlines at the end of sentences.")
    g.add_argument("--lang", default="english",
                   help="Accepted for compatibility; unused (sentences are split by a "
                        "punctuation rule, not a language model).")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece model / HF tokenizer path / "
                   "TikTokenizer rank file (.json or .tiktoken).")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json.")
    g.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt.")
    g.add_argument("--vocab-size", type=int,
                   help="NullTokenizer vocabulary size; TikTokenizer: total ids (optional).")
    g.add_argument("--tiktoken-pattern", choices=sorted(TIKTOKEN_PATTERNS),
                   help="TikTokenizer pre-tokenisation regex (default: v2).")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens (default: 1000).")
    g.add_argument("--tiktoken-special-tokens", nargs="+",
                   help="TikTokenizer: special tokens, ids 0, 1, ... (must include <unk> <s> "
                        "</s>).")
    g.add_argument("--append-eod", action="store_true",
                   help="Append the end-of-document token to each document.")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="Prefix of the output files.")
    g.add_argument("--workers", type=int, default=1, help="Tokenizer processes.")
    g.add_argument("--partitions", type=int, default=1,
                   help="Write the input in this many parts, then merge them.")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="Refresh the MB/s readout every this many documents (0: no bar).")
    g.add_argument("--strict", action="store_true",
                   help="Stop at the first skipped line (exit code 1) instead of counting it.")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="Accepted for compatibility (output order always follows the input).")
    args = p.parse_args(argv)
    if args.workers < 1 or args.partitions < 1:
        p.error("--workers and --partitions must be >= 1")
    return args


def main(argv=None) -> int:
    args = vars(parse_args(argv))
    # the handlers this run installs are put back on return (main() is also called in-process)
    previous = {sig: signal.signal(sig, interrupt_handler)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: dict) -> int:
    ignored = []
    if args.pop("lang") != "english":
        ignored.append("--lang (sentences are split by a punctuation rule, not a per-language "
                       "model)")
    if args.pop("keep_sequential_samples"):
        ignored.append("--keep-sequential-samples (the output always follows the input "
                       "order)")
    if ignored:
        print("accepted, no effect here: " + "; ".join(ignored), flush=True)
    try:
        # a parent that blocked SIGTERM / SIGINT (a blocked mask is inherited across exec)
        # must not leave this run unstoppable: the cleanup that deletes partial outputs needs
        # them (one already pending is raised here, as KeyboardInterrupt)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
        summary = preprocess(PreprocessOptions(**args))
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # e.g. the disk filled up while writing; partial outputs removed
        print(f"error: {e}; no output written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
