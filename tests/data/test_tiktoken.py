"""TikTokenizer from a rank file built here (no network): Megatron's id layout, both file
formats, the v1/v2 patterns, and errors."""

from __future__ import annotations

import base64
import json

import pytest

from megalite.config import DataConfig
from megalite.data.tokenizers import TikTokenizer, TokenizerError, build_tokenizer

pytest.importorskip("tiktoken")

# 256 single bytes, then merges. "oW" merges before "hello" is complete, so a pattern that
# keeps "helloWorld" in one piece (v1) encodes it differently from one that splits it at
# the case change (v2).
MERGES = [b"oW", b"he", b"ll", b"hell", b"hello", b"Wo", b"rl", b"rld", b" t", b" the"]
RANKS = [bytes([b]) for b in range(256)] + MERGES


def _write(tmp_path, fmt: str, ranks=RANKS) -> str:
    if fmt == "json":
        path = tmp_path / "ranks.json"
        path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                     "token_str": t.decode("latin-1")}
                                    for i, t in enumerate(ranks)]))
    else:
        path = tmp_path / "ranks.tiktoken"
        path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                for i, t in enumerate(ranks)))
    return str(path)


@pytest.mark.parametrize("fmt", ["json", "tiktoken"])
def test_ids_round_trip_and_special_tokens_first(tmp_path, fmt):
    tok = build_tokenizer(DataConfig(tokenizer_type="TikTokenizer",
                                     tokenizer_model=_write(tmp_path, fmt),
                                     tiktoken_pattern="v2", tiktoken_num_special_tokens=16))
    assert tok.vocab_size == 16 + len(RANKS)
    # Megatron's defaults: <unk> <s> </s> <mask> <pad> <cls> <sep>, then <SPECIAL_i> fillers.
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, 4)
    assert tok.special_tokens["<SPECIAL_15>"] == 15 and len(tok.special_tokens) == 16
    assert tok.tokenize("A") == [16 + ord("A")]  # byte rank r is id 16 + r
    hello = 16 + 256 + MERGES.index(b"hello")
    assert tok.tokenize("hello the") == [hello, 16 + 256 + MERGES.index(b" the")]
    text = "hello World, the end é\n"
    assert tok.detokenize(tok.tokenize(text)) == text
    ids = tok.tokenize("hello</s><pad>")
    assert ids == [hello, 2, 4] and tok.detokenize(ids) == "hello</s><pad>"


def test_patterns_v1_and_v2_split_words_differently(tmp_path):
    path = _write(tmp_path, "tiktoken")
    v1 = TikTokenizer(path, "v1", num_special_tokens=8)
    v2 = TikTokenizer(path, "v2", num_special_tokens=8)
    merged = lambda t: 8 + 256 + MERGES.index(t)  # noqa: E731
    assert merged(b"oW") in v1.tokenize("helloWorld")  # one pre-token: "oW" merges first
    assert v2.tokenize("helloWorld")[0] == merged(b"hello")  # "hello" | "World"
    assert v1.detokenize(v1.tokenize("helloWorld")) == "helloWorld"
    assert TikTokenizer(path, None, 8).tokenize("helloWorld") == v2.tokenize("helloWorld")


def test_custom_special_tokens_and_vocab_size(tmp_path):
    path = _write(tmp_path, "json")
    tok = TikTokenizer(path, "v2", num_special_tokens=4,
                       special_tokens=["</s>", "<s>", "<unk>", "<|im|>"])
    assert (tok.eod, tok.bos, tok.pad) == (0, 1, 0)  # no <pad>: pad falls back to eos
    assert tok.tokenize("<|im|>") == [3]
    # --vocab-size keeps the first vocab_size - num_special ranks (Megatron's truncation).
    small = TikTokenizer(path, "v2", num_special_tokens=4, vocab_size=4 + 258,
                         special_tokens=["<unk>", "<s>", "</s>"])
    assert small.vocab_size == 262 and max(small.tokenize("hello the world")) < 262


def test_errors_are_one_sentence(tmp_path):
    path = _write(tmp_path, "tiktoken")
    with pytest.raises(TokenizerError, match="must be distinct and include <unk> <s> </s>"):
        TikTokenizer(path, "v2", 8, special_tokens=["<s>", "</s>"])
    with pytest.raises(TokenizerError, match=r"--tiktoken-num-special-tokens \(2\) is smaller"):
        TikTokenizer(path, "v2", 2)
    with pytest.raises(TokenizerError, match="--vocab-size 100000 leaves"):
        TikTokenizer(path, "v2", 8, vocab_size=100000)
    with pytest.raises(TokenizerError, match="file not found"):
        TikTokenizer(str(tmp_path / "none.tiktoken"))
    with pytest.raises(TokenizerError, match="single bytes have no rank"):
        TikTokenizer(_write(tmp_path, "json", RANKS[1:]))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not-base64!! 0\n")
    with pytest.raises(TokenizerError, match=r"bad\.tiktoken: line 1 not a tiktoken rank file"):
        TikTokenizer(str(bad))


def test_preprocess_tool_takes_the_tiktoken_flags(tmp_path):
    from megalite.data.indexed_dataset import IndexedDataset
    from tests.tools import load_tool

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"hello the World {i}"})
                                for i in range(5)) + "\n")
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                      "--tokenizer-type", "TikTokenizer",
                      "--tokenizer-model", _write(tmp_path, "tiktoken"),
                      "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", "10",
                      "--append-eod", "--log-interval", "0"]) == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = TikTokenizer(_write(tmp_path, "tiktoken"), "v1", 10)
    assert ds.document(3).tolist() == [*tok.tokenize("hello the World 3"), 2]
