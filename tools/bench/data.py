"""Data pipeline throughput: preprocessing, index building, blending and sample reads.

``python tools/benchmark.py data [--tokens 1e8] [--seq-length 2048] [--mean-doc 500]``

1. Preprocessing the bundled corpus (data/kjv.jsonl.gz, ``--copies`` times over, with
   GPTSentencePieceTokenizer) with 1 and 2 workers: docs/s, MB/s of JSONL input, and the
   2-worker speedup over 1 worker.
2. Building the document/sample/shuffle indices of one epoch over ``--tokens`` tokens in
   documents of lognormal length (mean ``--mean-doc``): seconds per array, and the
   vectorized sample index against the plain-Python loop of the same semantics.
3. Blending indices for ``--blend-samples`` samples over 2 and 3 datasets.
4. Reading samples back (GPTDataset.__getitem__ on the bundled data): samples/s, tokens/s.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import numpy as np


def _timed(fn, repeat: int = 1):
    best, result = math.inf, None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_preprocess(workers_list, repeat: int, copies: int) -> None:
    import gzip
    import shutil

    from megalite.data.bundled import BUNDLED_CORPUS, BUNDLED_TOKENIZER_MODEL
    from megalite.data.preprocess import PreprocessOptions, preprocess

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "corpus.jsonl.gz")
        with open(source, "wb") as out:  # concatenated gzip members are one valid stream
            for _ in range(copies):
                with open(BUNDLED_CORPUS, "rb") as f:
                    shutil.copyfileobj(f, out)
        with gzip.open(source, "rb") as f:
            raw = sum(len(line) for line in f)
        print(f"preprocess {copies} x {os.path.basename(BUNDLED_CORPUS)} ({raw / 1e6:.1f} MB "
              f"of JSONL), best of {repeat}, process start-up excluded")
        print(f"{'workers':>8} {'seconds':>8} {'docs/s':>8} {'MB/s':>7} {'tokens/s':>10} "
              f"{'vs 1 worker':>12}")
        base = None
        for workers in workers_list:
            options = PreprocessOptions(
                input=source, output_prefix=os.path.join(tmp, f"w{workers}"),
                tokenizer_type="GPTSentencePieceTokenizer",
                tokenizer_model=BUNDLED_TOKENIZER_MODEL, append_eod=True, workers=workers,
                log_interval=0)
            seconds, summary = _timed(lambda o=options: preprocess(o), repeat)
            base = base or seconds
            tokens = sum(summary["tokens"].values())
            print(f"{workers:>8} {seconds:>8.2f} {summary['documents'] / seconds:>8.0f} "
                  f"{summary['bytes'] / seconds / 1e6:>7.2f} {tokens / seconds:>10.0f} "
                  f"{base / seconds:>11.2f}x")


def synthetic_lengths(num_tokens: int, mean_doc: int, seed: int = 0) -> np.ndarray:
    """int32 document lengths (lognormal, sigma 1) adding up to about ``num_tokens``."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    mu = math.log(mean_doc) - sigma ** 2 / 2
    lengths = np.maximum(1, rng.lognormal(mu, sigma, int(num_tokens / mean_doc * 1.1)))
    lengths = lengths.astype(np.int32)
    keep = np.searchsorted(np.cumsum(lengths, dtype=np.int64), num_tokens) + 1
    return lengths[:keep]


def bench_indices(num_tokens: int, seq_length: int, mean_doc: int, epochs: int,
                  loop: bool) -> None:
    from megalite.data.indices import (
        build_document_index,
        build_gpt_indices,
        build_sample_index,
        build_shuffle_index,
    )

    lengths = synthetic_lengths(num_tokens, mean_doc)
    documents = np.arange(len(lengths), dtype=np.int32)
    tokens_per_epoch = int(lengths.sum(dtype=np.int64))
    num_samples = (epochs * tokens_per_epoch - 1) // seq_length
    print(f"\nindices: {tokens_per_epoch / 1e6:.0f}M tokens/epoch in {len(lengths)} documents "
          f"(mean {tokens_per_epoch / len(lengths):.0f}), seq {seq_length}, {epochs} epoch(s), "
          f"{num_samples} samples")
    rng = np.random.RandomState(1234)
    t_doc, doc_index = _timed(lambda: build_document_index(documents, epochs, rng, False))
    t_sample, sample_index = _timed(lambda: build_sample_index(
        lengths, doc_index, seq_length, epochs, tokens_per_epoch))
    t_shuffle, _ = _timed(lambda: build_shuffle_index(num_samples, num_samples, rng))
    t_all, _ = _timed(lambda: build_gpt_indices(lengths, documents, seq_length, num_samples,
                                                seed=1234))
    print(f"  document index {t_doc:7.3f}s   sample index {t_sample:7.3f}s   "
          f"shuffle index {t_shuffle:7.3f}s   all three (build_gpt_indices) {t_all:7.3f}s")
    if loop:
        from tests.data.test_indices import sample_index_loop

        t_loop, reference = _timed(lambda: sample_index_loop(
            lengths, doc_index, seq_length, epochs, tokens_per_epoch))
        same = np.array_equal(reference, sample_index)
        print(f"  plain-Python loop sample index {t_loop:.3f}s: vectorized is "
              f"{t_loop / t_sample:.1f}x faster, arrays identical: {same}")


def bench_blending(num_samples: int) -> None:
    from megalite.data.indices import build_blending_indices

    print(f"\nblending indices for {num_samples} samples")
    for weights in ([0.3, 0.7], [0.2, 0.5, 0.3]):
        seconds, _ = _timed(lambda w=weights: build_blending_indices(w, num_samples))
        print(f"  {len(weights)} datasets: {seconds:.3f}s ({num_samples / seconds / 1e6:.2f}M "
              "samples/s)")


def bench_reads(seq_length: int, count: int) -> None:
    from megalite.data.bundled import ensure_bundled_dataset
    from megalite.data.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megalite.data.indexed_dataset import IndexedDataset

    prefix = ensure_bundled_dataset()
    indexed = IndexedDataset(prefix)
    with tempfile.TemporaryDirectory() as tmp:
        config = GPTDatasetConfig(seq_length=seq_length, seed=1, eod=2, pad=3, cache_dir=tmp)
        ds = GPTDataset(indexed, prefix, np.arange(len(indexed), dtype=np.int32), count,
                        "train", config)
        seconds, _ = _timed(lambda: [ds[i] for i in range(count)])
    print(f"\nreading {count} samples of {seq_length} tokens (bundled data): "
          f"{count / seconds:.0f} samples/s, {count * seq_length / seconds / 1e6:.2f}M "
          "tokens/s")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="benchmark.py data", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=float, default=1e8, help="Tokens for the index build.")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--mean-doc", type=int, default=500, help="Mean synthetic document length.")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--blend-samples", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=2, help="Preprocessing runs (best kept).")
    p.add_argument("--copies", type=int, default=4,
                   help="Preprocess the bundled corpus this many times over.")
    p.add_argument("--no-loop", action="store_true", help="Skip the plain-Python reference.")
    p.add_argument("--skip-preprocess", action="store_true")
    args = p.parse_args(argv)
    if not args.skip_preprocess:
        bench_preprocess([1, 2], args.repeat, args.copies)
    bench_indices(int(args.tokens), args.seq_length, args.mean_doc, args.epochs,
                  not args.no_loop)
    bench_blending(args.blend_samples)
    bench_reads(args.seq_length, 2000)

