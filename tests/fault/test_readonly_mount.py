"""Unwritable outputs under a real read-only mount: training's outputs and preprocessing's.

These tests run as root here, and root ignores permission bits, so a ``chmod`` test would
prove nothing (tests/training/test_preflight.py uses a path that cannot be created
instead). A read-only bind mount stops root too: each run happens in a private mount
namespace (``unshare -rm``: no privilege needed where user namespaces are enabled, and
nothing leaks to the host) in which a temporary directory is bind-mounted read-only onto
itself. ``--save``, ``--tensorboard-dir``, ``--metrics-jsonl`` and preprocessing's
``--output-prefix`` then each stop before any work with one line naming the flag, the path
and ``Read-only file system``."""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.training.common import ENTRYPOINT, REPO, subprocess_env, tiny_flags


@functools.lru_cache(maxsize=1)
def namespace_problem() -> str | None:
    """Why no read-only bind mount can be made in a private namespace here, or None."""
    probe = "d=$(mktemp -d) && mount --bind \"$d\" \"$d\" && mount -o remount,bind,ro \"$d\" " \
            "\"$d\" && ! touch \"$d/x\" 2>/dev/null"
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        return "no unshare command (util-linux)"
    if done.returncode != 0:
        return (f"mount namespaces unavailable (unshare -rm + a read-only bind mount: "
                f"{done.stderr.strip() or 'exit ' + str(done.returncode)})")
    return None


def run_under_readonly(directory, argv: list[str], env: dict | None = None):
    """``argv`` in a private mount namespace where ``directory`` is read-only."""
    if namespace_problem() is not None:
        pytest.skip(namespace_problem())
    d = shlex.quote(str(directory))
    script = (f"mount --bind {d} {d} && mount -o remount,bind,ro {d} {d} && "
              f"exec {shlex.join(argv)}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, timeout=300, env=env or subprocess_env(), cwd=REPO)


@pytest.mark.parametrize("flag,where", [
    ("--save", "ckpt"),                 # to be created under the read-only mount
    ("--tensorboard-dir", ""),          # exists, cannot take a file
    ("--metrics-jsonl", "m.jsonl"),     # its directory is the mount
])
def test_training_outputs_on_a_readonly_mount(tmp_path, flag, where):
    ro = tmp_path / "ro"
    ro.mkdir()
    path = str(ro / where) if where else str(ro)
    done = run_under_readonly(ro, [sys.executable, ENTRYPOINT, *tiny_flags(**{flag: path})])
    assert done.returncode == 2, done.stderr[-3000:]
    where_dir = f" (its directory {ro})" if flag == "--metrics-jsonl" else ""
    line = (f"megalite: error (rank 0): {flag} {path}: cannot create or write{where_dir}: "
            "Read-only file system; choose a writable location")
    assert line in done.stderr.splitlines(), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "iteration" not in done.stdout
    assert os.listdir(ro) == []


def test_preprocessing_output_on_a_readonly_mount(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i} of the corpus"}) + "\n"
                              for i in range(20)))
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = str(ro / "out")
    done = run_under_readonly(ro, [
        sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
        "--input", str(corpus), "--output-prefix", prefix,
        "--tokenizer-type", "GPTSentencePieceTokenizer",
        "--tokenizer-model", os.path.join(REPO, "data", "kjv_bpe_8k.model"),
        "--log-interval", "0"])
    assert done.returncode == 1, done.stderr[-3000:]
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and f"--output-prefix {prefix}: cannot write to the directory" \
        in err[0] and "Read-only file system" in err[0], done.stderr[-3000:]
    assert os.listdir(ro) == []
