#!/usr/bin/env bash
# Regenerate the bundled corpus and tokenizer (see data/README.md):
#   data/kjv.jsonl.gz       the King James Bible, one JSON document per chapter
#   data/kjv_bpe_8k.model   SentencePiece BPE, 8000 pieces, trained on it
#   data/kjv_bpe_8k.vocab
#   data/kjv_text_document.bin/.idx   the corpus preprocessed with that model
#                                     (GPTSentencePieceTokenizer, --append-eod)
# Needs Debian's apt-get and dpkg-deb (as root; runs `apt-get update` if needed); installs nothing:
# the packages are downloaded and unpacked into a temporary directory.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

(cd "$TMP" && { apt-get download bible-kjv bible-kjv-text 2>/dev/null \
    || { apt-get update -qq && apt-get download bible-kjv bible-kjv-text; }; })
for deb in "$TMP"/*.deb; do dpkg-deb -x "$deb" "$TMP/root"; done
"$TMP/root/usr/bin/bible" -m 8192 -p "$TMP/root/usr/lib" "gen1:1-rev22:21" > "$TMP/kjv.txt"

# The `bible` output: a blank line, "Book N", a blank line, then verses "  V text" wrapped
# at 80 columns (continuation lines start without indentation). One document per chapter:
# its title line, a blank line, then one verse per line without verse numbers.
"$PY" - "$TMP/kjv.txt" "$HERE/kjv.jsonl.gz" <<'EOF'
import gzip, json, re, sys

src, dst = sys.argv[1], sys.argv[2]
chapters, title, verses, prev_blank = [], None, [], True
for line in open(src, encoding="ascii"):
    line = line.rstrip("\n")
    if not line.strip():
        prev_blank = True
        continue
    verse = re.match(r"^\s+(\d+) (.*)$", line)
    heading = re.match(r"^(\S.*) (\d+)$", line) if prev_blank else None
    if heading and not verse:
        if title:
            chapters.append((title, verses))
        title, verses = f"{heading.group(1)} {heading.group(2)}", []
    elif verse:
        verses.append(verse.group(2).strip())
    else:
        verses[-1] += " " + line.strip()
    prev_blank = False
chapters.append((title, verses))
assert len(chapters) == 1189, len(chapters)
with open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
    for i, (title, verses) in enumerate(chapters):
        doc = {"id": i, "title": title, "text": title + "\n\n" + "\n".join(verses) + "\n"}
        f.write((json.dumps(doc) + "\n").encode("ascii"))
print(f"{len(chapters)} chapters, {sum(len(v) for _, v in chapters)} verses -> {dst}")
EOF

"$PY" "$ROOT/tools/train_tokenizer.py" --input "$HERE/kjv.jsonl.gz" \
    --model-prefix "$HERE/kjv_bpe_8k" --vocab-size 8000 --model-type bpe

"$PY" "$ROOT/tools/preprocess_data.py" --input "$HERE/kjv.jsonl.gz" \
    --output-prefix "$HERE/kjv" --tokenizer-type GPTSentencePieceTokenizer \
    --tokenizer-model "$HERE/kjv_bpe_8k.model" --append-eod --workers 2
