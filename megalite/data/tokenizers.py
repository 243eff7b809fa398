"""Tokenizers chosen by ``--tokenizer-type``, with Megatron-LM's semantics for ids.

Every tokenizer exposes ``vocab_size`` (ids are in ``[0, vocab_size)``), ``eod`` (the
end-of-document id that ``--append-eod`` appends), ``pad`` (a valid id used to fill padded
positions; padded positions are also masked out of the loss, so ``pad == eod`` is harmless),
``tokenize(str) -> list[int]`` and ``detokenize(list[int]) -> str``.

    SentencePieceTokenizer     --tokenizer-model m.model; like Megatron, appends <CLS>, <SEP>,
                               <EOD>, <MASK> (and pad/bos/eos pieces the model lacks) after
                               the model's pieces; eod is <EOD>; special strings in the text
                               map to their ids.
    GPTSentencePieceTokenizer  --tokenizer-model m.model; the model's pieces only; eod is the
                               model's eos id (Llama style).
    HuggingFaceTokenizer       --tokenizer-model: a local tokenizer.json file or a directory
                               saved by transformers (never the hub); eod is the eos token.
    GPT2BPETokenizer           --vocab-file vocab.json --merge-file merges.txt (byte-level
                               BPE through the ``tokenizers`` library); eod is <|endoftext|>.
    NullTokenizer              --vocab-size N; text is space-separated ids; eod is N and
                               vocab_size N + 1 (synthetic data).
"""

from __future__ import annotations

import json
import os
import re

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from the given files or flags."""


class Tokenizer:
    """Interface shared by all tokenizers (see the module docstring)."""

    vocab_size: int
    eod: int
    pad: int

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def _require_file(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise TokenizerError(f"{kind} needs {flag}")
    if not os.path.exists(path):
        raise TokenizerError(f"{path}: file not found ({flag} of {kind})")
    return path


# ----------------------------------------------------------------------------------------
# SentencePiece
# ----------------------------------------------------------------------------------------
class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model with Megatron's extra special tokens (see module docstring)."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.model_file = _require_file(model_file, "--tokenizer-model", type(self).__name__)
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{model_file}: not a SentencePiece model ({e})") from None
        self._setup()

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        if 0 <= piece_id < self.sp.get_piece_size():
            return self.sp.id_to_piece(piece_id)
        return fallback

    def _setup(self) -> None:
        vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special_tokens: dict[str, int] = {}
        names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>",
                 self._piece_or(self.sp.pad_id(), "<PAD>"),
                 self._piece_or(self.sp.bos_id(), "<BOS>"),
                 self._piece_or(self.sp.eos_id(), "<EOS>")]
        for name in names:
            if name not in vocab:
                vocab[name] = len(vocab)
            self.special_tokens[name] = vocab[name]
        self.vocab_size = len(vocab)
        self.eod = self.special_tokens["<EOD>"]
        self.pad = self.special_tokens[names[4]]
        self.bos = self.special_tokens[names[5]]
        self.eos = self.special_tokens[names[6]]
        self._special_by_id = {i: name for name, i in self.special_tokens.items()}
        # Leftmost special string wins; at one position the earlier-declared name wins.
        self._special_re = re.compile("|".join(re.escape(n) for n in self.special_tokens))

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(text):
            ids.extend(self.sp.encode_as_ids(text[start:match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids.extend(self.sp.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        parts, run = [], []
        for i in ids:
            if i in self._special_by_id:
                parts.append(self.sp.decode_ids(run) + " " + self._special_by_id[i] + " ")
                run = []
            else:
                run.append(i)
        parts.append(self.sp.decode_ids(run))
        return "".join(parts)


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """A SentencePiece model used as is; eod = eos (pad falls back to eos when unset)."""

    def _setup(self) -> None:
        self.vocab_size = self.sp.get_piece_size()
        self.bos = self.sp.bos_id()
        self.eos = self.sp.eos_id()
        if self.eos < 0:
            raise TokenizerError(f"{self.model_file}: the model has no eos piece, which "
                                 "GPTSentencePieceTokenizer uses as end of document")
        self.eod = self.eos
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.sp.decode_ids([int(i) for i in ids])


# ----------------------------------------------------------------------------------------
# Hugging Face
# ----------------------------------------------------------------------------------------
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>",
                   "[SEP]", "<EOD>")


class HuggingFaceTokenizer(Tokenizer):
    """A local Hugging Face tokenizer: a ``tokenizer.json`` file or a saved directory.

    Token ids are those of ``tokenizer(text).input_ids`` (special tokens its post-processor
    adds, e.g. a BOS, included, as Megatron does). ``eod`` is the eos token; a bare
    tokenizer.json carries no eos setting, so the first of </s>, <|endoftext|>, ... found in
    the vocabulary is used.
    """

    def __init__(self, path: str) -> None:
        path = _require_file(path, "--tokenizer-model", "HuggingFaceTokenizer")
        self.path = path
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{path}: cannot load a tokenizer from this directory "
                                     f"({e})") from None
            self._encode = lambda text: tok(text)["input_ids"]
            self._decode = lambda ids: tok.decode(ids)
            self.vocab_size = len(tok)
            vocab = tok.get_vocab()
            eos, pad = tok.eos_token_id, tok.pad_token_id
        else:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                tok = HFTokenizer.from_file(path)
            except Exception as e:  # noqa: BLE001 (the library raises a bare Exception)
                raise TokenizerError(f"{path}: not a tokenizers JSON file ({e})") from None
            self._encode = lambda text: tok.encode(text).ids
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
            vocab = tok.get_vocab(with_added_tokens=True)
            eos, pad = None, None
        if eos is None:
            eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise TokenizerError(f"{path}: no end-of-document token (set eos_token, or have "
                                 f"one of {', '.join(_EOS_CANDIDATES)} in the vocabulary)")
        self.eod = int(eos)
        self.pad = int(pad) if pad is not None else self.eod
        self._tok = tok

    def tokenize(self, text: str) -> list[int]:
        return list(self._encode(text))

    def detokenize(self, ids) -> str:
        return self._decode([int(i) for i in ids])


# ----------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ----------------------------------------------------------------------------------------
class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (no special tokens added)."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        _require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{vocab_file}: not a JSON vocabulary ({e})") from None
        if "<|endoftext|>" not in vocab:
            raise TokenizerError(f"{vocab_file}: has no <|endoftext|> token, which "
                                 "GPT2BPETokenizer uses as end of document")
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # noqa: BLE001 (the library raises a bare Exception)
            raise TokenizerError(f"{merge_file}: cannot read BPE merges ({e})") from None
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_size = len(vocab)
        self.eod = self.pad = int(vocab["<|endoftext|>"])

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


# ----------------------------------------------------------------------------------------
# Null (synthetic data)
# ----------------------------------------------------------------------------------------
class NullTokenizer(Tokenizer):
    """Text is space-separated integer ids; ``eod = vocab_size_arg``, vocab_size = arg + 1."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise TokenizerError(f"NullTokenizer needs a positive --vocab-size, got "
                                 f"{vocab_size}")
        self.eod = self.pad = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise TokenizerError(f"NullTokenizer reads space-separated integers, got "
                                 f"{text[:40]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# ----------------------------------------------------------------------------------------
# Factory
# ----------------------------------------------------------------------------------------
def create_tokenizer(tokenizer_type: str | None, *, tokenizer_model: str | None = None,
                     vocab_file: str | None = None, merge_file: str | None = None,
                     vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer from flag values (the form tools and worker processes use)."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        cls = (SentencePieceTokenizer if tokenizer_type == "SentencePieceTokenizer"
               else GPTSentencePieceTokenizer)
        return cls(_require_file(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(data_cfg, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer a :class:`megalite.config.DataConfig` asks for.

    ``vocab_size`` (ModelConfig.vocab_size) is used by NullTokenizer, which is also chosen
    when no tokenizer type is given together with ``--mock-data``.
    """
    kind = data_cfg.tokenizer_type
    if kind is None:
        if data_cfg.mock_data and vocab_size is not None:
            kind = "NullTokenizer"
        else:
            raise TokenizerError("--tokenizer-type is required (or --mock-data with "
                                 "--vocab-size for the NullTokenizer)")
    return create_tokenizer(kind, tokenizer_model=data_cfg.tokenizer_model,
                            vocab_file=data_cfg.vocab_file, merge_file=data_cfg.merge_file,
                            vocab_size=vocab_size)
