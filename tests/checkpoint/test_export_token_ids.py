"""A Hugging Face export writes the bos/eos ids of the tokenizer the model was trained with
into config.json (not the architecture's defaults: GPT-2's 50256 is no token of an
8000-token model, and generation would never stop at the end of a text)."""

from __future__ import annotations

import json
import os

import pytest

from megalite.checkpoint.consolidated import save_full_model
from megalite.data.tokenizers import create_tokenizer
from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from megalite.parallel.state import ParallelState
from tests.tools import load_tool
from tests.training.common import REPO, tiny_config

SP_MODEL = os.path.join(REPO, "data", "kjv_bpe_8k.model")
LLAMA = {**get_family("llama").defaults, "num_layers": 1, "hidden_size": 32,
         "num_attention_heads": 4, "ffn_hidden_size": 64}


def _checkpoint(root, vocab: int, data: dict, model: dict | None = None) -> str:
    """An iteration-0 checkpoint of a 1-layer model with a vocabulary of ``vocab`` whose
    config records the tokenizer settings ``data``, as training records them."""
    cfg = tiny_config(model={"num_layers": 1, "vocab_size": vocab, **(model or {})},
                      data=data)
    state = GPTModel(cfg.model, ParallelState.build(cfg.parallel), seed=1).full_state_dict()
    save_full_model(cfg, state, str(root))
    return str(root)


def _export(ckpt, out, capsys) -> tuple[dict, str]:
    code = load_tool("convert_checkpoint").main(["--source", "megalite", "--target", "hf",
                                                 "--load-dir", ckpt, "--save-dir", str(out)])
    assert code == 0
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f), capsys.readouterr().out


@pytest.mark.parametrize("kind, family, vocab, want", [
    ("GPTSentencePieceTokenizer", "gpt2", 8000, (1, 2)),     # the model's <s> and </s>
    ("SentencePieceTokenizer", "llama", 8004, (1, 8002)),   # Megatron's added <EOD>
])
def test_sentencepiece_ids(tmp_path, capsys, kind, family, vocab, want):
    tok = create_tokenizer(kind, tokenizer_model=SP_MODEL)
    assert (tok.vocab_size, tok.eod) == (vocab, want[1])
    ckpt = _checkpoint(tmp_path / "ckpt", vocab,
                       {"mock_data": False, "tokenizer_type": kind, "tokenizer_model": SP_MODEL},
                       LLAMA if family == "llama" else None)
    cfg, _ = _export(ckpt, tmp_path / "hf", capsys)
    assert cfg["model_type"] == family and cfg["vocab_size"] == vocab
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == want


def test_null_tokenizer_ids(tmp_path, capsys):
    """NullTokenizer(60): ids 0..59 and its end of document, 60 (the model's 61 tokens)."""
    ckpt = _checkpoint(tmp_path / "ckpt", 61, {"mock_data": True,
                                               "tokenizer_type": "NullTokenizer"})
    cfg, _ = _export(ckpt, tmp_path / "hf", capsys)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (60, 60)


def test_unreadable_tokenizer_warns_and_writes_no_foreign_ids(tmp_path, capsys):
    moved = tmp_path / "moved.model"
    moved.write_bytes(open(SP_MODEL, "rb").read())
    ckpt = _checkpoint(tmp_path / "ckpt", 8000, {"mock_data": False,
                                                 "tokenizer_type": "GPTSentencePieceTokenizer",
                                                 "tokenizer_model": str(moved)})
    moved.unlink()
    cfg, out = _export(ckpt, tmp_path / "hf", capsys)
    assert "config.json gets no bos/eos ids of the tokenizer the model was trained with" in out
    assert str(moved) in out
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None   # not GPT-2's 50256


def test_family_defaults_kept_only_inside_the_vocabulary():
    from megalite.config import ModelConfig

    gpt2 = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=61)
    big = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50257)
    spec = get_family("gpt2")
    assert spec.hf_config(gpt2).eos_token_id is None
    assert (spec.hf_config(big).bos_token_id, spec.hf_config(big).eos_token_id) == (50256,) * 2
    assert spec.hf_config(gpt2, (3, 4)).eos_token_id == 4
