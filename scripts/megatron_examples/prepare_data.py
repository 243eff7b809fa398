#!/usr/bin/env python
"""Data for the adapted Megatron-LM example scripts in this folder (run once, then cached).

The Llama-3 script reads its data through a Hugging Face tokenizer, the GPT-3 script through
GPT-2 style vocab.json + merges.txt. Neither ships with the repository, so this trains one
byte-level BPE (8000 ids, ``<|endoftext|>`` as end of document) on the bundled corpus with the
``tokenizers`` library, saves it in both forms, and tokenizes the corpus with it:

    OUT/bpe/tokenizer.json              --tokenizer-type HuggingFaceTokenizer
    OUT/bpe/vocab.json, merges.txt      --tokenizer-type GPT2BPETokenizer
    OUT/kjv_bpe_text_document.bin/.idx  --data-path (the same ids for both)

    python scripts/megatron_examples/prepare_data.py [OUT]   # OUT: runs/megatron_examples
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "data" / "kjv.jsonl.gz"


def main(out: str) -> int:
    out_dir = Path(out)
    bpe = out_dir / "bpe"
    prefix = out_dir / "kjv_bpe"
    if (out_dir / "kjv_bpe_text_document.idx").exists():
        return 0
    from tokenizers import ByteLevelBPETokenizer

    bpe.mkdir(parents=True, exist_ok=True)
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=8000, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(bpe))
    tok.save(str(bpe / "tokenizer.json"))
    return subprocess.call([
        sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(CORPUS),
        "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", str(bpe / "vocab.json"), "--merge-file", str(bpe / "merges.txt"),
        "--append-eod", "--workers", str(min(2, os.cpu_count() or 1)), "--log-interval", "0"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "runs" / "megatron_examples")))
