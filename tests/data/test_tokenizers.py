"""Every --tokenizer-type, built from files made here or shipped in data/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalite.config import DataConfig
from megalite.data.bundled import BUNDLED_TOKENIZER_MODEL
from megalite.data.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    TokenizerError,
    build_tokenizer,
    create_tokenizer,
)

TEXT = "In the beginning God created the heaven and the earth.\nAnd the earth was void."


def test_gpt_sentencepiece():
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer",
                                     tokenizer_model=BUNDLED_TOKENIZER_MODEL))
    assert (tok.vocab_size, tok.eod, tok.pad) == (8000, 2, 3)
    ids = tok.tokenize(TEXT)
    assert 0 < len(ids) < len(TEXT) // 2 and max(ids) < 8000
    assert tok.detokenize(ids) == TEXT


def test_megatron_sentencepiece_adds_special_tokens():
    tok = create_tokenizer("SentencePieceTokenizer", tokenizer_model=BUNDLED_TOKENIZER_MODEL)
    # The model has <pad>, <s>, </s>; Megatron's wrapper appends <CLS> <SEP> <EOD> <MASK>.
    assert tok.vocab_size == 8004
    assert (tok.eod, tok.pad, tok.bos, tok.eos) == (8002, 3, 1, 2)
    plain = create_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=BUNDLED_TOKENIZER_MODEL)
    assert tok.tokenize(TEXT) == plain.tokenize(TEXT)
    ids = tok.tokenize("And God said<EOD>Let there be light")
    assert ids.count(8002) == 1
    assert "<EOD>" in tok.detokenize(ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture
def gpt2_files(tmp_path):
    alphabet = list(_bytes_to_unicode().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "o"), ("lo", "w")]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), vocab


def test_gpt2_bpe(gpt2_files):
    vocab_file, merge_file, vocab = gpt2_files
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file,
                                     merge_file=merge_file))
    assert tok.vocab_size == 256 + 5 + 1 and tok.eod == vocab["<|endoftext|>"] == tok.pad
    ids = tok.tokenize("low the thelow é")
    assert ids == [vocab["low"], vocab["Ġthe"], vocab["Ġthe"], vocab["low"], vocab["Ġ"],
                   vocab["Ã"], vocab["©"]]  # é is two bytes
    assert tok.detokenize(ids) == "low the thelow é"
    # The same files through transformers' GPT-2 tokenizer give the same ids.
    from transformers import GPT2Tokenizer

    ref = GPT2Tokenizer.from_pretrained(str(Path(vocab_file).parent), local_files_only=True)
    assert ref("low the thelow é")["input_ids"] == ids


def test_gpt2_bpe_errors(gpt2_files, tmp_path):
    vocab_file, merge_file, vocab = gpt2_files
    with pytest.raises(TokenizerError, match="needs --merge-file"):
        GPT2BPETokenizer(vocab_file, None)
    del vocab["<|endoftext|>"]
    (tmp_path / "v2.json").write_text(json.dumps(vocab))
    with pytest.raises(TokenizerError, match=r"v2\.json: has no <\|endoftext\|>"):
        GPT2BPETokenizer(str(tmp_path / "v2.json"), merge_file)


def _tiny_hf_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<pad>", "</s>"])
    tok.train_from_iterator([TEXT] * 20, trainer)
    return tok


def test_huggingface_tokenizer_json(tmp_path):
    _tiny_hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer",
                                     tokenizer_model=str(tmp_path / "tokenizer.json")))
    assert tok.eod == 2 and tok.pad == 2  # "</s>" found in the vocabulary
    ids = tok.tokenize("the earth")
    assert ids and max(ids) < tok.vocab_size <= 120
    assert tok.detokenize(ids).replace(" ", "") == "theearth"


def test_huggingface_directory(tmp_path):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_tiny_hf_tokenizer(), eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(str(tmp_path / "tok"))
    tok = HuggingFaceTokenizer(str(tmp_path / "tok"))
    assert (tok.eod, tok.pad) == (2, 1)
    assert tok.tokenize("the earth") == fast("the earth")["input_ids"]
    with pytest.raises(TokenizerError, match="file not found"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))


def test_null_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("1 2 3") == [1, 2, 3] and tok.detokenize([4, 5]) == "4 5"
    assert isinstance(build_tokenizer(DataConfig(mock_data=True), vocab_size=64), NullTokenizer)
    with pytest.raises(TokenizerError, match="positive --vocab-size"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


def test_missing_model_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"nope\.model: file not found"):
        create_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        create_tokenizer("GPTSentencePieceTokenizer",
                         tokenizer_model=str(tmp_path / "junk.model"))
    with pytest.raises(TokenizerError, match="--tokenizer-type is required"):
        build_tokenizer(DataConfig())


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_tokenizer_tool(tmp_path, model_type):
    from tests.tools import load_tool

    corpus = tmp_path / "c.jsonl"
    lines = [json.dumps({"text": f"{TEXT} Verse {i}.\nAnd God saw it."}) for i in range(200)]
    corpus.write_text("\n".join(lines + ["not json"]) + "\n")
    prefix = tmp_path / "spm"
    tool = load_tool("train_tokenizer")
    assert tool.main(["--input", str(corpus), "--model-prefix", str(prefix),
                      "--vocab-size", "296", "--model-type", model_type]) == 0
    tok = create_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=f"{prefix}.model")
    assert (tok.vocab_size, tok.eod, tok.pad) == (296, 2, 3)
    sample = "And God saw the light, Verse 12.\n\nNew line; unseen: Zebra ü"
    assert tok.detokenize(tok.tokenize(sample)) == sample  # identity + byte fallback
    assert len((tmp_path / "spm.vocab").read_text().splitlines()) == 296
    with pytest.raises(SystemExit, match="Vocabulary size too high"):
        tool.main(["--input", str(corpus), "--model-prefix", str(prefix), "--vocab-size",
                   "5000", "--model-type", model_type])


def test_llama2_tokenizer_prepends_bos():
    tok = create_tokenizer("Llama2Tokenizer", tokenizer_model=BUNDLED_TOKENIZER_MODEL)
    plain = create_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=BUNDLED_TOKENIZER_MODEL)
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (8000, 2, 1, 3)
    ids = tok.tokenize(TEXT)
    assert ids == [1, *plain.tokenize(TEXT)]
    assert tok.detokenize(ids) == TEXT
    built = build_tokenizer(DataConfig(tokenizer_type="Llama2Tokenizer",
                                       tokenizer_model=BUNDLED_TOKENIZER_MODEL))
    assert built.tokenize("And God said") == tok.tokenize("And God said")


def test_gpt2_bpe_files_from_the_tokenizers_library(tmp_path):
    """vocab.json + merges.txt written by `tokenizers` load offline, same ids both ways."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator([TEXT] * 20, vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(tmp_path))
    tok = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert tok.eod == 0 and tok.vocab_size == bpe.get_vocab_size()
    assert tok.tokenize(TEXT) == bpe.encode(TEXT).ids
    assert tok.detokenize(tok.tokenize(TEXT)) == TEXT


def test_gpt2_bpe_missing_files_one_sentence(gpt2_files, tmp_path):
    vocab_file, merge_file, _ = gpt2_files
    with pytest.raises(TokenizerError) as err:
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                   vocab_file=str(tmp_path / "gone.json"), merge_file=merge_file))
    assert str(err.value) == f"{tmp_path / 'gone.json'}: file not found (--vocab-file of " \
                             "GPT2BPETokenizer)"
    with pytest.raises(TokenizerError, match=r"^GPT2BPETokenizer needs --vocab-file$"):
        build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", merge_file=merge_file))


def test_every_tokenizer_type_is_built_by_the_factory():
    """Each --tokenizer-type the config accepts reaches a tokenizer class (an error about
    its files or flags, never "unknown --tokenizer-type"); other names are refused."""
    from megalite.config.data import TOKENIZER_TYPES
    from megalite.config.fields import ConfigError
    from megalite.data.tokenizers import create_tokenizer

    for name in TOKENIZER_TYPES:
        try:
            create_tokenizer(name, vocab_size=8)
        except Exception as e:  # missing files or flags: the factory knows the type
            assert "unknown --tokenizer-type" not in str(e), name
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type"):
        create_tokenizer("Llama3Tokenizer")
    with pytest.raises(ConfigError, match="tokenizer_type must be one of"):
        DataConfig(tokenizer_type="Llama3Tokenizer")
