#!/usr/bin/env python
"""Train a SentencePiece (BPE or unigram) model on text or JSONL files.

    python tools/train_tokenizer.py --input corpus.jsonl.gz --model-prefix out/spm \\
        --vocab-size 8000 --model-type bpe

writes ``out/spm.model`` and ``out/spm.vocab``. Inputs ending in ``.jsonl``/``.json`` (optionally
``.gz``) are read as one JSON object per line (``--json-keys``, default ``text``); anything
else as plain text, one document per line. Each document is one training sentence (runs of
its lines when longer than ``--max-sentence-length``). The model keeps text as is (identity
normalization, whitespace kept) and has ``\\n`` as a piece of its own, so
``detokenize(tokenize(text)) == text`` for text it covers; ``--byte-fallback`` (on by
default) encodes unseen characters as bytes.

Ids: unk 0, bos 1, eos 2, pad 3. Use it with ``--tokenizer-type GPTSentencePieceTokenizer``
(eod = eos) or ``SentencePieceTokenizer`` (Megatron's extra <CLS>/<SEP>/<EOD>/<MASK> ids).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.data.jsonl import iter_texts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="Text or JSONL files (.gz ok).")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys to read.")
    p.add_argument("--model-prefix", required=True, help="Output prefix (.model/.vocab).")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="Encode characters outside the vocabulary as UTF-8 bytes.")
    p.add_argument("--max-sentence-length", type=int, default=16384,
                   help="Longer training sentences (bytes) are skipped.")
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="Sample at most this many sentences (0: use all).")
    p.add_argument("--num-threads", type=int, default=1)
    return p.parse_args(argv)


def iter_sentences(paths, json_keys, max_bytes):
    """Training sentences: whole documents, or runs of their lines when longer than max_bytes.

    Whole documents (rather than single lines) let the model learn words that follow a
    newline, which carry no leading-space marker.
    """
    for path in paths:
        for text in iter_texts(path, json_keys):
            if len(text.encode("utf-8")) <= max_bytes:
                yield text
                continue
            chunk, size = [], 0
            for line in text.split("\n"):
                n = len(line.encode("utf-8")) + 1
                if chunk and size + n > max_bytes:
                    yield "\n".join(chunk)
                    chunk, size = [], 0
                chunk.append(line)
                size += n
            if chunk:
                yield "\n".join(chunk)


def train(args: argparse.Namespace) -> str:
    import sentencepiece as spm

    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"error: {path}: input file not found")
    os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
    sentences = list(iter_sentences(args.input, args.json_keys, args.max_sentence_length))
    if not sentences:
        raise SystemExit(f"error: no text found in {', '.join(args.input)} "
                         f"(json keys: {', '.join(args.json_keys)})")
    start = time.time()
    model = io.BytesIO()  # written by us, so no local path ends up inside the model
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            byte_fallback=args.byte_fallback,
            max_sentence_length=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=False,
            num_threads=args.num_threads,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            user_defined_symbols=["\n"],
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            minloglevel=2,
        )
    except RuntimeError as e:  # sentencepiece reports bad settings this way
        raise SystemExit(f"error: sentencepiece training failed: {e}") from None
    with open(args.model_prefix + ".model", "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with open(args.model_prefix + ".vocab", "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i).replace("\n", "\\n")  # keep one piece per line
            f.write(f"{piece}\t{sp.get_score(i):g}\n")
    print(f"trained a {args.vocab_size}-piece {args.model_type} model on {len(sentences)} "
          f"sentences in {time.time() - start:.1f}s -> {args.model_prefix}.model")
    return args.model_prefix + ".model"


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
