"""Flags megalite accepts without effect are named once at start-up, and the run trains."""

import subprocess

from megalite.arguments import parse_args
from megalite.compat import IMPLEMENTED, NO_EFFECT, REFUSED, flag_status, no_effect_line
from tests.training.common import ENTRYPOINT, PYTHON, read_jsonl, subprocess_env, tiny_flags


def test_no_effect_line_lists_each_flag_with_its_reason():
    assert no_effect_line(parse_args([])) is None
    line = no_effect_line(parse_args(["--no-mmap-bin-files", "--empty-unused-memory-level",
                                      "2", "--no-create-attention-mask-in-dataloader"]))
    assert line.startswith("accepted, no effect here: ")
    assert "--empty-unused-memory-level 2 (it empties the CUDA caching allocator" in line
    assert "; --no-mmap-bin-files (the .bin is read with plain file reads" in line
    assert "--no-create-attention-mask-in-dataloader (megalite never builds a mask" in line


def test_flag_status_reads_the_parser():
    assert flag_status("--lr", ["1e-3"]) == (IMPLEMENTED, "")
    assert flag_status("--no-mmap-bin-files")[0] == NO_EFFECT
    assert flag_status("--no-such-flag") == (REFUSED, "unknown flag")
    status, reason = flag_status("--tokenizer-type", ["NoSuchTokenizer"])
    assert status == REFUSED and "invalid choice: 'NoSuchTokenizer'" in reason


def test_entrypoint_prints_the_line_once_and_trains(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    flags = tiny_flags(**{"--train-iters": 3, "--metrics-jsonl": metrics,
                          "--no-create-attention-mask-in-dataloader": None,
                          "--empty-unused-memory-level": 1})
    proc = subprocess.run([PYTHON, ENTRYPOINT, *flags], env=subprocess_env(),
                          capture_output=True, text=True, timeout=180, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in out.splitlines() if "accepted, no effect here" in ln]
    assert len(lines) == 1, out
    assert lines[0].startswith("accepted, no effect here: --empty-unused-memory-level 1 (")
    assert "--no-create-attention-mask-in-dataloader (" in lines[0]
    assert [r["iteration"] for r in read_jsonl(metrics)] == [1, 2, 3]
