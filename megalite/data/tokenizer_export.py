"""A megalite tokenizer as Hugging Face tokenizer files, for an export to ``transformers``.

:func:`save_hf_tokenizer` writes ``tokenizer.json`` / ``tokenizer_config.json`` (and the
SentencePiece ``tokenizer.model``) so that ``AutoTokenizer.from_pretrained(out)`` encodes
as megalite's tokenizer did, with the ids megalite used: the same vocabulary (Megatron's
special tokens appended to a SentencePiece model included), eos the end-of-document id
training appended, bos the tokenizer's own begin-of-text id (GPT-2's convention,
``<|endoftext|>`` as both, otherwise), which is what the export's ``config.json`` records
(:func:`megalite.models.families.spec.trained_token_ids`).

    HuggingFaceTokenizer        the directory saved again (``save_pretrained``), or a bare
                                tokenizer.json wrapped with its eos/pad tokens
    GPT2BPETokenizer            the byte-level BPE megalite builds, wrapped (eos = bos =
                                unk = <|endoftext|>)
    GPTSentencePieceTokenizer,  the SentencePiece model converted by transformers
    Llama2Tokenizer,            (LlamaTokenizer, no legacy prefix handling; Llama2Tokenizer
    SentencePieceTokenizer      adds bos); SentencePieceTokenizer's appended <CLS> <SEP>
                                <EOD> <MASK> ... as special tokens at their ids, eos <EOD>
    TikTokenizer, NullTokenizer none (:class:`NotExportable` says why)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from megalite.data.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
)
from megalite.models.families.spec import trained_token_ids

# the files transformers reads or writes for a tokenizer (whichever a directory has)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json")
# encoded by both tokenizers after an export, to check they agree
PROBE = "In the beginning God created the heaven and the earth.\nAnd the earth was 42."


class NotExportable(TokenizerError):
    """A tokenizer with no Hugging Face form megalite writes."""


def save_hf_tokenizer(tokenizer: Tokenizer, out: str) -> list[str]:
    """Write ``tokenizer`` to the directory ``out`` in Hugging Face's format; the files
    written. :class:`NotExportable` for a tokenizer with no such form; a
    :class:`TokenizerError` when the written files do not encode :data:`PROBE` as
    ``tokenizer`` does or have another vocabulary (the files stay, for inspection)."""
    hf = _hf_tokenizer(tokenizer)
    bos, eos = trained_token_ids(tokenizer)
    hf.eos_token = hf.convert_ids_to_tokens(eos)
    if hf.bos_token is None or bos != eos:
        hf.bos_token = hf.convert_ids_to_tokens(bos)
    saved_by_hf = isinstance(tokenizer, HuggingFaceTokenizer) and os.path.isdir(tokenizer.path)
    if hf.pad_token is None and not saved_by_hf:   # a saved tokenizer's own settings stay
        hf.pad_token = hf.convert_ids_to_tokens(int(tokenizer.pad))
    os.makedirs(out, exist_ok=True)
    hf.save_pretrained(out)
    if isinstance(tokenizer, SentencePieceTokenizer):  # the slow tokenizer's file, too
        shutil.copyfile(tokenizer.model_file, os.path.join(out, "tokenizer.model"))
    check_export(tokenizer, out)
    return [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(out, n))]


def check_export(tokenizer: Tokenizer, out: str) -> None:
    """Raise :class:`TokenizerError` unless ``AutoTokenizer.from_pretrained(out)`` has
    ``tokenizer``'s vocabulary and eos and encodes :data:`PROBE` to the same ids."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ours, theirs = tokenizer.tokenize(PROBE), hf(PROBE)["input_ids"]
    problems = []
    if len(hf) != tokenizer.vocab_size:
        problems.append(f"{len(hf)} tokens instead of {tokenizer.vocab_size}")
    if hf.eos_token_id != tokenizer.eod:
        problems.append(f"eos {hf.eos_token_id} instead of {tokenizer.eod}")
    if ours != theirs:
        problems.append(f"{PROBE!r} encodes to {theirs[:12]} instead of {ours[:12]}")
    if problems:
        raise TokenizerError(f"the tokenizer written to {out} differs from {tokenizer!r}: "
                             f"{'; '.join(problems)}")


def _hf_tokenizer(tokenizer: Tokenizer):
    """A ``transformers`` tokenizer for ``tokenizer`` (special tokens set later)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if isinstance(tokenizer, HuggingFaceTokenizer):
        if os.path.isdir(tokenizer.path):
            return AutoTokenizer.from_pretrained(tokenizer.path, local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
    if isinstance(tokenizer, GPT2BPETokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok,
                                       unk_token="<|endoftext|>")
    if isinstance(tokenizer, SentencePieceTokenizer):
        return _sentencepiece(tokenizer)
    raise NotExportable(f"{type(tokenizer).__name__} has no Hugging Face tokenizer form "
                        f"that megalite writes")


def _sentencepiece(tokenizer: SentencePieceTokenizer):
    """transformers' conversion of the SentencePiece model (as ``LlamaTokenizer``, which
    reads ``tokenizer.model``), with Megatron's appended special tokens at their ids."""
    from transformers import AutoTokenizer

    sp = tokenizer.sp
    pieces = sp.get_piece_size()

    def piece(i: int, default: str | None) -> str | None:
        return sp.id_to_piece(i) if 0 <= i < pieces else default

    config = {"tokenizer_class": "LlamaTokenizer", "legacy": False,
              "add_bos_token": type(tokenizer).__name__ == "Llama2Tokenizer",
              "add_eos_token": False, "unk_token": piece(sp.unk_id(), None),
              "bos_token": piece(sp.bos_id(), None), "eos_token": piece(sp.eos_id(), None),
              "pad_token": piece(sp.pad_id(), None)}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(tokenizer.model_file, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        hf = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    added = getattr(tokenizer, "special_tokens", None)
    if added and type(tokenizer) is SentencePieceTokenizer:
        extra = sorted((i, name) for name, i in added.items() if i >= pieces)
        hf.add_tokens([name for _, name in extra], special_tokens=True)
        got = hf.convert_tokens_to_ids([name for _, name in extra])
        if got != [i for i, _ in extra]:
            raise TokenizerError(f"Megatron's special tokens got ids {got} in the Hugging "
                                 f"Face tokenizer instead of {[i for i, _ in extra]}")
    return hf
