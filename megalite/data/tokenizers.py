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
    Llama2Tokenizer            --tokenizer-model m.model; as GPTSentencePieceTokenizer, and
                               every tokenize() call starts with the model's bos id (Megatron's
                               Llama-2 wrapper); eod is eos.
    HuggingFaceTokenizer       --tokenizer-model: a local tokenizer.json file or a directory
                               saved by transformers (never the hub); eod is the eos token.
    GPT2BPETokenizer           --vocab-file vocab.json --merge-file merges.txt (byte-level
                               BPE through the ``tokenizers`` library); eod is <|endoftext|>.
    TikTokenizer               --tokenizer-model ranks.json|ranks.tiktoken (a local file,
                               never fetched) --tiktoken-pattern v1|v2
                               --tiktoken-num-special-tokens K --tiktoken-special-tokens ...;
                               ids 0..K-1 are the special tokens, BPE rank r is id K + r; eod
                               is </s> (see :class:`TikTokenizer`).
    NullTokenizer              --vocab-size N; text is space-separated ids; eod is N and
                               vocab_size N + 1 (synthetic data).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re

from megalite.config.data import TOKENIZER_TYPES
from megalite.errors import DataError


class TokenizerError(DataError, ValueError):
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


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's Llama-2 SentencePiece wrapper: the model's pieces, ``bos`` first in every
    ``tokenize`` result, eod = eos (pad falls back to eos when the model has none)."""

    def _setup(self) -> None:
        super()._setup()
        if self.bos < 0:
            raise TokenizerError(f"{self.model_file}: the model has no bos piece, which "
                                 "Llama2Tokenizer puts at the start of every text")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self.sp.encode_as_ids(text)]


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
            eos, pad, bos = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
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
            eos, pad, bos = None, None, None
        if eos is None:
            eos = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise TokenizerError(f"{path}: no end-of-document token (set eos_token, or have "
                                 f"one of {', '.join(_EOS_CANDIDATES)} in the vocabulary)")
        self.eod = int(eos)
        self.pad = int(pad) if pad is not None else self.eod
        self.bos = int(bos) if bos is not None else None   # the tokenizer's own, if any
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
# tiktoken
# ----------------------------------------------------------------------------------------
def _tiktoken_patterns() -> dict[str, str]:
    """Megatron's two pre-tokenisation regexes (data, assembled from their alternatives).

    v1 splits words as runs of letters; v2 (Llama-3 style) also splits a word at a lower- to
    upper-case step ("camelCase" -> "camel", "Case") and keeps "/" and newlines after
    punctuation with it.
    """
    lead = r"[^\r\n\p{L}\p{N}]?"  # one optional non-letter, non-digit before a word
    upper = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
    lower = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    v1 = [lead + r"+\p{L}+", r"\p{N}", r" ?[^\s\p{L}\p{N}]++[\r\n]*", r"\s*[\r\n]",
          r"\s+(?!\S)", r"\s+"]
    v2 = [lead + upper + "*" + lower + "+", lead + upper + "+" + lower + "*", r"\p{N}",
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"]
    return {"v1": "|".join(v1), "v2": "|".join(v2)}


TIKTOKEN_PATTERNS = _tiktoken_patterns()
TIKTOKEN_DEFAULT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a local BPE rank file, in either of two formats.

    ``*.json``: Megatron's list of ``{"rank": i, "token_bytes": base64, "token_str": ...}``
    in rank order. Anything else: tiktoken's text format, one ``base64 rank`` per line.
    (Read here rather than with ``tiktoken.load``, which caches files by path name.)
    Every single byte must have a rank, so any text can be encoded.
    """
    ranks: dict[bytes, int] = {}
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                entries = json.load(f)
            if not isinstance(entries, list):
                raise TokenizerError(f"{path}: expected a JSON list of {{rank, token_bytes, "
                                     f"token_str}} objects")
            for i, entry in enumerate(entries):
                if not isinstance(entry, dict) or entry.get("rank") != i:
                    raise TokenizerError(f"{path}: entry {i} must be an object with "
                                         f"\"rank\": {i} (ranks in order from 0)")
                ranks[base64.b64decode(entry["token_bytes"], validate=True)] = i
        else:
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (KeyError, ValueError, binascii.Error, UnicodeDecodeError) as e:
        where = "" if path.endswith(".json") else f" line {n}"
        raise TokenizerError(f"{path}:{where} not a tiktoken rank file ({type(e).__name__}: "
                             f"{e})") from None
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{path}: two tokens share a rank")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: {len(missing)} single bytes have no rank (first: "
                             f"{missing[0]}); a byte-level BPE file ranks all 256 bytes")
    return ranks


class TikTokenizer(Tokenizer):
    """Byte-level BPE through the ``tiktoken`` package, with Megatron's id layout.

    Ids ``0 .. num_special_tokens-1`` are the special tokens (``special_tokens`` in order,
    then fillers ``<SPECIAL_i>``); BPE rank ``r`` is id ``num_special_tokens + r``. With
    ``vocab_size`` (``--vocab-size``) only the ranks below ``vocab_size - num_special_tokens``
    are kept (the file must have that many); without it every rank of the file is used
    (Megatron defaults to 2**17 ids instead). eod = eos = ``</s>``, bos = ``<s>``, pad =
    ``<pad>`` (eos when absent). Special-token strings in the text encode to their ids.
    """

    def __init__(self, path: str, pattern: str | None = None, num_special_tokens: int = 1000,
                 special_tokens=None, vocab_size: int | None = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("TikTokenizer needs the tiktoken package: pip install "
                                 "tiktoken") from None
        path = _require_file(path, "--tokenizer-model", "TikTokenizer")
        pattern = pattern or "v2"
        if pattern not in TIKTOKEN_PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        special = list(TIKTOKEN_DEFAULT_SPECIAL_TOKENS if special_tokens is None
                       else special_tokens)
        missing = [t for t in TIKTOKEN_REQUIRED_SPECIAL_TOKENS if t not in special]
        if missing or len(set(special)) != len(special):
            raise TokenizerError(f"--tiktoken-special-tokens must be distinct and include "
                                 f"{' '.join(TIKTOKEN_REQUIRED_SPECIAL_TOKENS)}; got "
                                 f"{' '.join(special)}")
        if num_special_tokens < len(special):
            raise TokenizerError(f"--tiktoken-num-special-tokens ({num_special_tokens}) is "
                                 f"smaller than the {len(special)} special tokens")
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        ranks = read_tiktoken_ranks(path)
        if vocab_size is not None:
            inner = vocab_size - num_special_tokens
            if inner < 256 or inner > len(ranks):
                raise TokenizerError(
                    f"--vocab-size {vocab_size} leaves {inner} ids for BPE ranks after "
                    f"{num_special_tokens} special tokens; {path} has {len(ranks)} (need 256 "
                    f"to {len(ranks)})")
            ranks = {tok: r for tok, r in ranks.items() if r < inner}
        else:
            inner = max(ranks.values()) + 1
        self.vocab_size = num_special_tokens + inner
        self.num_special_tokens = num_special_tokens
        self.special_tokens = {name: i for i, name in enumerate(special)}
        self._enc = tiktoken.Encoding(
            name=os.path.splitext(os.path.basename(path))[0],
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={tok: r + num_special_tokens for tok, r in ranks.items()},
            special_tokens=self.special_tokens)
        self.bos = self.special_tokens["<s>"]
        self.eod = self.eos = self.special_tokens["</s>"]
        self.pad = self.special_tokens.get("<pad>", self.eos)

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


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
_SENTENCEPIECE = {"SentencePieceTokenizer": SentencePieceTokenizer,
                  "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                  "Llama2Tokenizer": Llama2Tokenizer}


def create_tokenizer(tokenizer_type: str | None, *, tokenizer_model: str | None = None,
                     vocab_file: str | None = None, merge_file: str | None = None,
                     vocab_size: int | None = None, tiktoken_pattern: str | None = None,
                     tiktoken_num_special_tokens: int = 1000,
                     tiktoken_special_tokens=None) -> Tokenizer:
    """Build a tokenizer from flag values (the form tools and worker processes use)."""
    if tokenizer_type in _SENTENCEPIECE:
        return _SENTENCEPIECE[tokenizer_type](
            _require_file(tokenizer_model, "--tokenizer-model", tokenizer_type))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken_pattern, tiktoken_num_special_tokens,
                            tiktoken_special_tokens, vocab_size)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")


def build_tokenizer(data_cfg, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer a :class:`megalite.config.DataConfig` asks for.

    ``vocab_size`` (ModelConfig.vocab_size) is used by NullTokenizer, which is also chosen
    when no tokenizer type is given together with ``--mock-data``, and by TikTokenizer.
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
                            vocab_size=vocab_size, tiktoken_pattern=data_cfg.tiktoken_pattern,
                            tiktoken_num_special_tokens=data_cfg.tiktoken_num_special_tokens,
                            tiktoken_special_tokens=data_cfg.tiktoken_special_tokens)
