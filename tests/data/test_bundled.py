"""The bundled corpus, tokenizer and preprocessed dataset."""

from __future__ import annotations

import gzip
import json

from megalite.data.bundled import (
    BUNDLED_CORPUS,
    BUNDLED_PREFIX,
    BUNDLED_TOKENIZER_MODEL,
    BUNDLED_TOKENIZER_TYPE,
    ensure_bundled_dataset,
)
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import create_tokenizer


def test_shipped_dataset_matches_corpus_and_tokenizer():
    assert ensure_bundled_dataset() == BUNDLED_PREFIX
    ds = IndexedDataset(BUNDLED_PREFIX, verify_pointers=True)
    tok = create_tokenizer(BUNDLED_TOKENIZER_TYPE, tokenizer_model=BUNDLED_TOKENIZER_MODEL)
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        docs = [json.loads(line) for line in f]
    assert len(docs) == ds.num_documents == 1189
    assert docs[0]["title"] == "Genesis 1" and docs[-1]["title"] == "Revelation 22"
    for i in (0, 1, 500, 1188):
        assert ds.document(i).tolist() == tok.tokenize(docs[i]["text"]) + [tok.eod]
        assert tok.detokenize(ds.document(i)[:-1].tolist()) == docs[i]["text"]
    assert 900_000 < ds.num_tokens < 1_100_000


def test_other_tokenizer_type_is_preprocessed_into_the_cache(tmp_path):
    prefix = ensure_bundled_dataset(cache_dir=str(tmp_path),
                                    tokenizer_type="SentencePieceTokenizer")
    assert prefix.startswith(str(tmp_path))
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 1189 and ds.document(0)[-1] == 8002  # Megatron's <EOD>
    assert ensure_bundled_dataset(cache_dir=str(tmp_path),
                                  tokenizer_type="SentencePieceTokenizer") == prefix
