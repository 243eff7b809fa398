"""tools/preprocess_data.py: outputs, parallel workers, and every kind of bad input."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from megalite.data.bundled import BUNDLED_TOKENIZER_MODEL
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import create_tokenizer
from tests.tools import load_tool

TOOL = load_tool("preprocess_data")
TOKENIZER = create_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=BUNDLED_TOKENIZER_MODEL)
TEXTS = [f"In the beginning number {i} was {'very ' * (i % 7)}good.\nAnd it was so."
         for i in range(300)]


def run(tmp_path, input_path, *extra, name="out"):
    argv = ["--input", str(input_path), "--output-prefix", str(tmp_path / name),
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
            BUNDLED_TOKENIZER_MODEL, "--log-interval", "0", *extra]
    return TOOL.main(argv)


def write_jsonl(path, lines, gz=False):
    data = b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines)
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def outputs(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".jsonl"))


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "corpus.jsonl", [json.dumps({"text": t}) for t in TEXTS])


def test_tokens_match_the_tokenizer(tmp_path, corpus, capsys):
    assert run(tmp_path, corpus, "--append-eod") == 0
    out = capsys.readouterr().out
    assert "done: 300 documents" in out and "docs/s" in out and "MB/s" in out
    ds = IndexedDataset(str(tmp_path / "out_text_document"), verify_pointers=True)
    assert ds.dtype == np.uint16 and ds.num_documents == 300
    for i in (0, 1, 150, 299):
        assert ds.document(i).tolist() == TOKENIZER.tokenize(TEXTS[i]) + [TOKENIZER.eod]


def test_workers_partitions_and_gzip_give_the_same_bytes(tmp_path, corpus):
    assert run(tmp_path, corpus, "--append-eod", name="one") == 0
    gz = write_jsonl(tmp_path / "corpus.jsonl.gz", [json.dumps({"text": t}) for t in TEXTS],
                     gz=True)
    assert run(tmp_path, gz, "--append-eod", "--workers", "2", "--partitions", "3",
               name="two") == 0
    for ext in (".bin", ".idx"):
        one = (tmp_path / f"one_text_document{ext}").read_bytes()
        assert one == (tmp_path / f"two_text_document{ext}").read_bytes()
    assert not [n for n in outputs(tmp_path) if "part" in n or "tmp" in n]


def test_several_keys_and_sentences(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps({"a": "One. Two! Three?", "b": "x"})])
    assert run(tmp_path, src, "--json-keys", "a", "b", "--split-sentences", "--append-eod") == 0
    a = IndexedDataset(str(tmp_path / "out_a_sentence"))
    b = IndexedDataset(str(tmp_path / "out_b_sentence"))
    assert a.num_documents == 1 and len(a) == 3  # three sentences, eod on the last
    assert a[2].tolist()[-1] == TOKENIZER.eod
    assert b.document(0).tolist() == TOKENIZER.tokenize("x") + [TOKENIZER.eod]


BAD_LINES = [
    (b'{"text": "fine"}', None),
    (b'{"text": "broken', "malformed JSON"),
    (b'{"other": "x"}', "missing key 'text'"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8"),
    (b'{"text": ""}', "empty document in key 'text'"),
    (b'{"text": "   "}', "empty document in key 'text'"),
    (b'[1, 2]', "not a JSON object"),
    (b'{"text": 5}', "key 'text' is not text"),
]


def test_bad_lines_are_counted_and_reported(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [ln for ln, _ in BAD_LINES] + [b""])
    assert run(tmp_path, src, "--workers", "2") == 0
    out = capsys.readouterr().out
    assert "done: 1 documents" in out and "skipped 7 lines" in out
    for number, (_, reason) in enumerate(BAD_LINES, start=1):
        if reason:
            summary_line = next(ln for ln in out.splitlines() if reason in ln)
            assert str(number) in summary_line.split("(line")[1]
    assert "ignored 1 blank lines" in out
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == 1


@pytest.mark.parametrize("number", range(2, len(BAD_LINES) + 1))
@pytest.mark.parametrize("workers", ["1", "2"])
def test_strict_stops_with_the_line_number_and_writes_nothing(tmp_path, capsys, number,
                                                              workers):
    lines = [b'{"text": "good"}'] * 600  # several chunks before the bad line
    lines.insert(550, BAD_LINES[number - 1][0])
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    assert run(tmp_path, src, "--strict", "--workers", workers) == 1
    err = capsys.readouterr().err
    assert f"line 551: {BAD_LINES[number - 1][1]}" in err
    assert "--strict" in err
    assert outputs(tmp_path) == []  # no output and no temporaries


def test_corrupt_gzip_is_an_error_without_output(tmp_path, corpus, capsys):
    gz = write_jsonl(tmp_path / "c.jsonl.gz", [json.dumps({"text": t}) for t in TEXTS], gz=True)
    data = gz.read_bytes()
    gz.write_bytes(data[: len(data) // 2])
    for workers in ("1", "2"):
        assert run(tmp_path, gz, "--workers", workers) == 1
        assert "c.jsonl.gz: cannot read the input" in capsys.readouterr().err
    assert outputs(tmp_path) == ["c.jsonl.gz"]


def test_missing_input_and_bad_tokenizer(tmp_path, capsys):
    assert run(tmp_path, tmp_path / "nope.jsonl") == 1
    assert "nope.jsonl: input file not found" in capsys.readouterr().err
    src = write_jsonl(tmp_path / "in.jsonl", ['{"text": "a"}'])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json")]
    assert TOOL.main(argv) == 1
    assert "GPT2BPETokenizer" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o_text_document.bin")


def test_null_tokenizer_and_int32_outputs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ['{"text": "1 2 70000"}'])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "n"), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100000", "--append-eod", "--log-interval", "0"]
    assert TOOL.main(argv) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [1, 2, 70000, 100000]


def test_interrupted_run_leaves_nothing(tmp_path):
    """SIGTERM in the middle of a run (2 workers): exit 130, no outputs, no temporaries,
    even when the tool was started with SIGTERM blocked."""
    import signal
    import subprocess
    import sys

    from tests.data.conftest import REPO

    # ~25 s of work (the signal ends it within a second): the signal must land mid-run even
    # when this process is descheduled for a while after the bar appears (12,000 documents
    # took 0.4 s; with ~5 s of work the run sometimes finished first under load)
    block = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    src = tmp_path / "big.jsonl"
    src.write_bytes(block * 2500)
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
           "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
           "GPTSentencePieceTokenizer", "--tokenizer-model", BUNDLED_TOKENIZER_MODEL,
           "--workers", "2", "--log-interval", "1"]
    # started with SIGTERM blocked, as a parent that blocked it leaves a child (the mask is
    # inherited across exec; a test before this one in the suite left pytest's so): the
    # tool unblocks what it handles
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK,
                                                                      {signal.SIGTERM}))
    proc.stderr.read(11)  # "preprocess:" -- the progress bar is up, the handlers are set
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-500:]
    assert b"no output written" in err
    assert outputs(tmp_path) == []


def test_empty_input_is_an_error_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"")
    for partitions in ("1", "2"):
        assert run(tmp_path, src, "--partitions", partitions) == 1
        err = capsys.readouterr().err
        assert "empty.jsonl: no documents to write (the input is empty)" in err
        assert "no output written" in err and len(err.strip().splitlines()) == 1
        assert outputs(tmp_path) == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_all_malformed_input_is_an_error_with_counts_per_reason(tmp_path, capsys, workers):
    lines = [b"{not json"] * 7 + [b'{"other": "x"}'] * 2 + [b"", b'{"text": ""}']
    src = write_jsonl(tmp_path / "bad.jsonl", lines)
    assert run(tmp_path, src, "--workers", workers) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl: no documents to write (11 lines read, 1 blank, " in err
    assert "7 x malformed JSON (lines 1, 2, 3, 4, 5, ...)" in err
    assert "2 x missing key 'text' (lines 8, 9)" in err
    assert "1 x empty document in key 'text' (line 11)" in err
    assert outputs(tmp_path) == []


def test_unwritable_output_directory_is_one_clear_error(tmp_path, corpus, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    argv = ["--input", str(corpus), "--output-prefix", str(blocker / "sub" / "out"),
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
            BUNDLED_TOKENIZER_MODEL, "--log-interval", "0"]
    assert TOOL.main(argv) == 1
    err = capsys.readouterr().err
    assert f"--output-prefix {blocker / 'sub' / 'out'}: cannot write to the directory" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_interrupt_dropped_where_python_ignores_exceptions_still_stops_the_run(
        tmp_path, corpus, monkeypatch, capsys, workers):
    """Python runs a signal handler between any two bytecodes of the main thread, a
    ``__del__`` included, where the KeyboardInterrupt it raises is printed and dropped: the
    run must stop anyway, with nothing written."""
    from megalite.data import preprocess as engine

    seen = []
    original = engine.Stats.add_chunk

    def add_chunk(self, *args, **kwargs):
        seen.append(1)
        if len(seen) == 2:   # the handler runs inside something that swallows its exception
            try:
                engine.interrupt_handler(15, None)
            except KeyboardInterrupt:
                pass
        return original(self, *args, **kwargs)

    monkeypatch.setattr(engine, "CHUNK_LINES", 16)
    monkeypatch.setattr(engine.Stats, "add_chunk", add_chunk)
    assert run(tmp_path, corpus, "--workers", workers) == 130
    assert "interrupted; no output written" in capsys.readouterr().err
    assert outputs(tmp_path) == []
    assert len(seen) == 2   # stopped at the next chunk, not at the end of the input
