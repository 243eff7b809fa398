"""Tokenizers travel with checkpoints: an HF -> megalite conversion carries the source's
tokenizer (``SAVE/tokenizer/``), which generate and evaluate then use without tokenizer
flags, with the same tokens as when the flags name it; a megalite -> HF export writes
tokenizer files that ``AutoTokenizer.from_pretrained`` reads and that encode as megalite's
tokenizer did, with config.json's bos/eos ids."""

from __future__ import annotations

import json
import os
from argparse import Namespace

import pytest
import torch

from megalite.checkpoint.consolidated import save_full_model
from megalite.checkpoint.tokenizer_dir import carried_tokenizer, use_carried_tokenizer
from megalite.config import DataConfig
from megalite.data.tokenizers import create_tokenizer
from megalite.inference.generation import generate_batch
from megalite.inference.loading import load_for_inference
from megalite.inference.sampling import SamplingParams
from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from megalite.parallel.state import ParallelState
from tests.tools import load_tool
from tests.training.common import REPO, tiny_config

SP_MODEL = os.path.join(REPO, "data", "kjv_bpe_8k.model")
TEXTS = ["In the beginning God created the heaven and the earth.",
         "And the earth was without form, and void; and darkness was upon the deep.\nAnd God",
         "Let there be light: and there was light 1234."]
LLAMA = {**get_family("llama").defaults, "num_layers": 1, "hidden_size": 32,
         "num_attention_heads": 4, "ffn_hidden_size": 64}


def _tool(name, *argv):
    return load_tool(name).main([str(a) for a in argv])


def _bpe(vocab_size=200, byte_level=False, specials=("<unk>", "<s>", "</s>", "<pad>")):
    """A BPE tokenizer trained here on TEXTS (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials))
    tok.train_from_iterator(TEXTS * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A tiny Llama saved by transformers with a tokenizer that puts <s> first (Llama's
    post-processor) and ends documents with </s>."""
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    src = str(tmp_path_factory.mktemp("hf") / "llama")
    bpe = _bpe()
    bpe.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(src)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=32,
                                 tie_word_embeddings=False)).save_pretrained(src)
    return src


@pytest.fixture(scope="module")
def converted(hf_source, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megalite") / "ckpt")
    assert _tool("convert_checkpoint", "--source", "hf", "--target", "megalite",
                 "--load-dir", hf_source, "--save-dir", out) == 0
    return out


def test_conversion_carries_the_tokenizer(hf_source, converted, tmp_path, capsys):
    carried = carried_tokenizer(converted)
    assert carried == os.path.join(converted, "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(hf_source, name), "rb") as a, \
                open(os.path.join(carried, name), "rb") as b:
            assert a.read() == b.read(), name
    assert not [n for n in os.listdir(converted) if ".tmp" in n or ".old" in n]
    # a source without tokenizer files: a note, no folder, and the conversion succeeds
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(hf_source):
        if name in ("config.json", "model.safetensors"):
            os.symlink(os.path.join(hf_source, name), bare / name)
    capsys.readouterr()
    assert _tool("convert_checkpoint", "--source", "hf", "--target", "megalite",
                 "--load-dir", bare, "--save-dir", tmp_path / "out") == 0
    out = capsys.readouterr().out
    assert "holds no tokenizer files" in out and "--tokenizer-model" in out
    assert carried_tokenizer(str(tmp_path / "out")) is None


def test_loading_without_flags_uses_the_carried_tokenizer(hf_source, converted):
    from transformers import AutoTokenizer

    flags = Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_source,
                      vocab_file=None, merge_file=None)
    _, model, plain = load_for_inference(converted, args=Namespace(
        tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None))
    _, _, named = load_for_inference(converted, args=flags)
    ref = AutoTokenizer.from_pretrained(hf_source, local_files_only=True)
    for text in TEXTS:
        assert plain.tokenize(text) == named.tokenize(text) == ref(text)["input_ids"]
        assert plain.tokenize(text)[0] == ref.bos_token_id
    assert (plain.eod, plain.bos) == (ref.eos_token_id, ref.bos_token_id)
    prompts = [plain.tokenize(t) for t in TEXTS]
    greedy = SamplingParams(0.0, 0, 0.0)
    assert generate_batch(model, prompts, 6, greedy, eod=plain.eod) == \
        generate_batch(model, [named.tokenize(t) for t in TEXTS], 6, greedy, eod=named.eod)


def test_generate_and_evaluate_need_no_tokenizer_flags(hf_source, converted, tmp_path,
                                                       capsys):
    explicit = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_source]
    outputs = []
    for extra in ([], explicit):
        assert _tool("generate", "--load", converted, "--prompt", TEXTS[0],
                     "--max-new-tokens", 5, "--temperature", 0, *extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith(f"[{TEXTS[0]}]")
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    losses = []
    for extra in ([], explicit):
        assert _tool("evaluate", "--load", converted, "--jsonl", jsonl, "--no-progress",
                     *extra) == 0
        losses.append(capsys.readouterr().out)
    assert "lm loss value" in losses[0] and losses[0] == losses[1]


def test_flags_and_recorded_tokenizers_win_over_the_carried_one(converted):
    cases = [(DataConfig(), True), (DataConfig(tokenizer_type="HuggingFaceTokenizer"), True),
             (DataConfig(mock_data=True), False),
             (DataConfig(tokenizer_type="GPTSentencePieceTokenizer"), False),
             (DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="x"), False)]
    for data, uses in cases:
        before = (data.tokenizer_type, data.tokenizer_model)
        assert (use_carried_tokenizer(data, converted) is not None) == uses
        if not uses:
            assert (data.tokenizer_type, data.tokenizer_model) == before
    assert use_carried_tokenizer(DataConfig(), None) is None
    # a recorded Hugging Face directory that is gone (the checkpoint moved): the carried one
    gone = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/gone/tok")
    assert use_carried_tokenizer(gone, converted) is None          # a flag: not replaced
    assert use_carried_tokenizer(gone, converted, replace_missing=True) == \
        gone.tokenizer_model == os.path.join(converted, "tokenizer")


def test_training_load_uses_the_carried_tokenizer(hf_source, converted, tmp_path, capsys):
    """--load of a converted checkpoint, no tokenizer flags, real data: the run reads the
    carried tokenizer (and its vocabulary sizes the model, as the checkpoint's) and its own
    checkpoints carry it too, so they still generate once the source is gone."""
    import shutil

    import numpy as np

    from megalite.data.indexed_dataset import IndexedDatasetWriter
    from megalite.training.build import build_components
    from megalite.training.loop import train

    tok = create_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_source)
    copy, save = str(tmp_path / "converted"), str(tmp_path / "finetuned")
    shutil.copytree(converted, copy)
    prefix = str(tmp_path / "docs")
    with IndexedDatasetWriter(prefix, np.uint16) as out:
        for text in TEXTS * 10:
            out.add_document(np.array(tok.tokenize(text) + [tok.eod], dtype=np.uint16))
    cfg = tiny_config(model={**LLAMA, "vocab_size": None, "make_vocab_size_divisible_by": 1,
                             "max_position_embeddings": 32},
                      data={"mock_data": False, "tokenizer_type": None,
                            "data_path": [prefix], "split": "100,0,0"},
                      train={"train_iters": 2, "global_batch_size": 2},
                      checkpoint={"load": copy, "finetune": True, "save": save,
                                  "save_interval": 2})
    c = build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)
    assert c.cfg.data.tokenizer_model == os.path.join(copy, "tokenizer")
    assert c.cfg.model.vocab_size == tok.vocab_size
    assert all(torch.isfinite(torch.tensor(x)) for x in train(c).losses.values())
    c.close()
    assert sorted(os.listdir(carried_tokenizer(save))) == sorted(os.listdir(
        os.path.join(copy, "tokenizer")))
    shutil.rmtree(copy)        # the tokenizer the run's config names is gone
    capsys.readouterr()
    assert _tool("generate", "--load", save, "--prompt", TEXTS[0], "--max-new-tokens", 3,
                 "--temperature", 0) == 0
    assert capsys.readouterr().out.startswith(f"[{TEXTS[0]}]")


# -- megalite -> Hugging Face ------------------------------------------------------------
def _checkpoint(root, vocab: int, data: dict) -> str:
    cfg = tiny_config(model={**LLAMA, "vocab_size": vocab}, data=data)
    state = GPTModel(cfg.model, ParallelState.build(cfg.parallel), seed=1).full_state_dict()
    save_full_model(cfg, state, str(root))
    return str(root)


def _export(ckpt, out, *extra) -> dict:
    assert _tool("convert_checkpoint", "--source", "megalite", "--target", "hf",
                 "--load-dir", ckpt, "--save-dir", out, *extra) == 0
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def _same_tokenizer(ours, out, hf_cfg):
    """AutoTokenizer on ``out`` encodes TEXTS as ``ours``, decodes them back, and has
    config.json's bos/eos ids as its special tokens."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert len(hf) == ours.vocab_size
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True).strip() == \
            ours.detokenize([i for i in ids if i != getattr(ours, "bos", None)]).strip()
    assert (hf.bos_token_id, hf.eos_token_id) == (hf_cfg["bos_token_id"],
                                                  hf_cfg["eos_token_id"])
    assert hf.eos_token_id == ours.eod
    return hf


@pytest.mark.parametrize("kind", ["GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                  "SentencePieceTokenizer"])
def test_export_writes_sentencepiece_tokenizers(tmp_path, kind):
    ours = create_tokenizer(kind, tokenizer_model=SP_MODEL)
    ckpt = _checkpoint(tmp_path / "ckpt", ours.vocab_size,
                       {"mock_data": False, "tokenizer_type": kind, "tokenizer_model": SP_MODEL})
    out = str(tmp_path / "hf")
    hf_cfg = _export(ckpt, out)
    assert os.path.exists(os.path.join(out, "tokenizer.model"))
    hf = _same_tokenizer(ours, out, hf_cfg)
    assert hf("x")["input_ids"][:1] == ([ours.bos] if kind == "Llama2Tokenizer" else
                                        ours.tokenize("x")[:1])
    if kind == "SentencePieceTokenizer":   # Megatron's appended specials at their ids
        assert hf.convert_tokens_to_ids(["<CLS>", "<SEP>", "<EOD>", "<MASK>"]) == \
            [ours.special_tokens[t] for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>")]
        # the text before a special string encodes the same (after it, megalite's wrapper
        # starts a new SentencePiece text, with its space marker; transformers does not)
        assert hf("a<EOD>b")["input_ids"][:2] == ours.tokenize("a<EOD>b")[:2] == [264, 8002]


def test_export_writes_gpt2_bpe_and_tokenizer_json(tmp_path):
    bpe = _bpe(vocab_size=400, byte_level=True, specials=("<|endoftext|>",))
    bpe.model.save(str(tmp_path))
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    ours = create_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    ckpt = _checkpoint(tmp_path / "gpt2", ours.vocab_size,
                       {"mock_data": False, "tokenizer_type": "GPT2BPETokenizer",
                        "vocab_file": vocab, "merge_file": merges})
    hf_cfg = _export(ckpt, str(tmp_path / "gpt2_hf"))
    _same_tokenizer(ours, str(tmp_path / "gpt2_hf"), hf_cfg)
    assert hf_cfg["bos_token_id"] == hf_cfg["eos_token_id"] == ours.eod

    _bpe().save(str(tmp_path / "tokenizer.json"))    # a bare tokenizer.json file
    path = str(tmp_path / "tokenizer.json")
    ours = create_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    ckpt = _checkpoint(tmp_path / "file", ours.vocab_size,
                       {"mock_data": False, "tokenizer_type": "HuggingFaceTokenizer",
                        "tokenizer_model": path})
    hf_cfg = _export(ckpt, str(tmp_path / "file_hf"))
    _same_tokenizer(ours, str(tmp_path / "file_hf"), hf_cfg)


def test_hf_megalite_hf_round_trip_keeps_the_tokenizer(hf_source, converted, tmp_path):
    from transformers import AutoTokenizer

    out = str(tmp_path / "back")
    hf_cfg = _export(converted, out)
    src = AutoTokenizer.from_pretrained(hf_source, local_files_only=True)
    back = AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in TEXTS:
        ids = src(text)["input_ids"]
        assert back(text)["input_ids"] == ids
        assert back.decode(ids) == src.decode(ids)
    assert (back.bos_token, back.eos_token, back.pad_token, back.unk_token) == \
        (src.bos_token, src.eos_token, src.pad_token, src.unk_token)
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (src.bos_token_id,
                                                                src.eos_token_id)


def test_export_without_a_tokenizer_says_how_to_add_one(hf_source, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt", 61, {"mock_data": True,
                                               "tokenizer_type": "NullTokenizer"})
    _export(ckpt, str(tmp_path / "null"))
    assert "no tokenizer files: the model was trained on mock data" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "null" / "tokenizer_config.json")
    # a checkpoint recording no tokenizer: one note; the flags add one
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(hf_source, local_files_only=True))
    ckpt = _checkpoint(tmp_path / "none", vocab, {"mock_data": False, "tokenizer_type": None,
                                                  "data_path": ["x"]})
    _export(ckpt, str(tmp_path / "none_hf"))
    out = capsys.readouterr().out
    assert "gets no tokenizer" in out and "--tokenizer-model" in out
    assert not os.path.exists(tmp_path / "none_hf" / "tokenizer.json")
    _export(ckpt, str(tmp_path / "named_hf"), "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", hf_source)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "named_hf"))(TEXTS[0])["input_ids"] \
        == AutoTokenizer.from_pretrained(hf_source)(TEXTS[0])["input_ids"]
