"""The corpus that ships in ``data/`` (see data/README.md), ready to train on offline.

    prefix = ensure_bundled_dataset()     # .bin/.idx prefix for --data-path
    --tokenizer-type BUNDLED_TOKENIZER_TYPE --tokenizer-model BUNDLED_TOKENIZER_MODEL

``data/kjv_text_document.bin/.idx`` ship preprocessed with the bundled tokenizer as
``GPTSentencePieceTokenizer`` (eod = eos = 2, vocab 8000). Other tokenizer types (whose
eod id differs) or an explicit ``cache_dir`` (such as a run's ``--data-cache-path``) get
their own copy, made on first use and reused afterwards: in ``cache_dir``, else in
``<user cache dir>/bundled`` (``$MEGALITE_CACHE_DIR``, ``$XDG_CACHE_HOME/megalite`` or
``~/.cache/megalite``; see :mod:`megalite.data.cache_dirs`). Nothing is written under
``data/``, which may be read-only or part of an installed package.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megalite.data.cache_dirs import user_cache_dir
from megalite.data.indexed_dataset import exists

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
BUNDLED_CORPUS = str(DATA_DIR / "kjv.jsonl.gz")
BUNDLED_TOKENIZER_MODEL = str(DATA_DIR / "kjv_bpe_8k.model")
BUNDLED_TOKENIZER_TYPE = "GPTSentencePieceTokenizer"
BUNDLED_PREFIX = str(DATA_DIR / "kjv_text_document")  # shipped, made as BUNDLED_TOKENIZER_TYPE


def bundled_cache_dir() -> str:
    """Where other tokenizations of the corpus go by default: ``<user cache dir>/bundled``."""
    return os.path.join(user_cache_dir(), "bundled")


def ensure_bundled_dataset(cache_dir: str | None = None,
                           tokenizer_type: str = BUNDLED_TOKENIZER_TYPE) -> str:
    """The prefix of the bundled corpus tokenized with the bundled model as ``tokenizer_type``
    (``GPTSentencePieceTokenizer`` or ``SentencePieceTokenizer``), preprocessing it first if
    needed (about a second) into ``cache_dir`` or :func:`bundled_cache_dir`. Safe to call
    from several processes at once."""
    if tokenizer_type not in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        raise ValueError(f"the bundled tokenizer is a SentencePiece model; tokenizer_type "
                         f"{tokenizer_type!r} cannot use it")
    if cache_dir is None and tokenizer_type == BUNDLED_TOKENIZER_TYPE and exists(BUNDLED_PREFIX):
        return BUNDLED_PREFIX
    for path in (BUNDLED_CORPUS, BUNDLED_TOKENIZER_MODEL):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: bundled file missing (regenerate with "
                                    "data/make_corpus.sh)")
    cache_dir = cache_dir or bundled_cache_dir()
    # One user cache serves every checkout and version: name the copy after its inputs.
    output = os.path.join(cache_dir, f"kjv_{tokenizer_type}_{_inputs_digest()}")
    prefix = f"{output}_text_document"
    if not exists(prefix):
        from megalite.data.preprocess import PreprocessOptions, preprocess

        preprocess(PreprocessOptions(
            input=BUNDLED_CORPUS, output_prefix=output, tokenizer_type=tokenizer_type,
            tokenizer_model=BUNDLED_TOKENIZER_MODEL, append_eod=True, log_interval=0,
            strict=True))
    return prefix


def _inputs_digest() -> str:
    """8 hex digits of an md5 over the corpus and the tokenizer model (a few ms)."""
    digest = hashlib.md5()
    for path in (BUNDLED_CORPUS, BUNDLED_TOKENIZER_MODEL):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]
