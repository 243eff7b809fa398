"""Run-time caches stay out of megalite's own tree.

The bundled corpus lives in ``data/`` inside the source tree; its other tokenizations and
the index caches of datasets there go to the user cache directory, never next to the data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from megalite.data import cache_dirs
from megalite.data.builder import build_datasets
from megalite.data.bundled import BUNDLED_PREFIX, DATA_DIR, ensure_bundled_dataset
from tests.data.conftest import REPO, write_dataset


def _listing(root: Path) -> dict:
    """{relative path: (size, mtime_ns)} of every file under ``root``."""
    out = {}
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _data_cfg(prefix: str, cache: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(mock_data=False, data_path=[prefix], split="98,2,0",
                           train_data_path=None, valid_data_path=None, test_data_path=None,
                           data_cache_path=cache, reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False)


_TOKENIZER = SimpleNamespace(eod=2, pad=3, vocab_size=8000)


def test_user_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MEGALITE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dirs.user_cache_dir() == str(tmp_path / "home" / ".cache" / "megalite")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec ignores these
    assert cache_dirs.user_cache_dir() == str(tmp_path / "home" / ".cache" / "megalite")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dirs.user_cache_dir() == str(tmp_path / "xdg" / "megalite")
    monkeypatch.setenv("MEGALITE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dirs.user_cache_dir() == str(tmp_path / "mine")


def test_index_cache_placement(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGALITE_CACHE_DIR", str(tmp_path / "user"))
    # the bundled data (inside the source tree): the user cache directory
    assert cache_dirs.inside_source_tree(BUNDLED_PREFIX)
    assert cache_dirs.default_index_cache_dir(BUNDLED_PREFIX) == str(
        tmp_path / "user" / "GPTDataset_indices")
    # anyone else's data: next to it, as Megatron does
    theirs = str(tmp_path / "corpus" / "text_document")
    assert not cache_dirs.inside_source_tree(theirs)
    assert cache_dirs.default_index_cache_dir(theirs) == str(
        tmp_path / "corpus" / "cache" / "GPTDataset_indices")


def test_data_cache_path_keeps_megatrons_meaning(monkeypatch, tmp_path, rng):
    monkeypatch.setenv("MEGALITE_CACHE_DIR", str(tmp_path / "user"))
    prefix = write_dataset(tmp_path / "corpus" / "doc", [rng.integers(0, 100, 50)
                                                         for _ in range(40)])
    train, _, _ = build_datasets(_data_cfg(prefix, str(tmp_path / "dc")), _TOKENIZER,
                                 seq_length=16, seed=1, num_samples=(10, 2, 0))
    assert os.path.dirname(train.cache_paths["description"]) == str(tmp_path / "dc")
    train, _, _ = build_datasets(_data_cfg(prefix), _TOKENIZER, seq_length=16, seed=1,
                                 num_samples=(10, 2, 0))
    assert train.cache_paths["description"].startswith(str(tmp_path / "corpus" / "cache"))
    assert not (tmp_path / "user").exists()


def test_bundled_data_writes_nothing_into_the_repo(monkeypatch, tmp_path):
    """The in-repo run: other tokenization + index caches land where the env var says."""
    monkeypatch.setenv("MEGALITE_CACHE_DIR", str(tmp_path / "user"))
    before = _listing(DATA_DIR)
    prefix = ensure_bundled_dataset(tokenizer_type="SentencePieceTokenizer")
    train, valid, _ = build_datasets(_data_cfg(BUNDLED_PREFIX), _TOKENIZER, seq_length=64,
                                     seed=5, num_samples=(32, 8, 0))
    assert _listing(DATA_DIR) == before
    assert prefix.startswith(str(tmp_path / "user" / "bundled") + os.sep)
    for ds in (train, valid):
        assert all(p.startswith(str(tmp_path / "user" / "GPTDataset_indices") + os.sep)
                   and os.path.isfile(p) for p in ds.cache_paths.values())


_CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import megalite
    from megalite.data.builder import build_datasets
    from megalite.data.bundled import BUNDLED_PREFIX, ensure_bundled_dataset

    cfg = SimpleNamespace(mock_data=False, data_path=[BUNDLED_PREFIX], split="98,2,0",
                          train_data_path=None, valid_data_path=None, test_data_path=None,
                          data_cache_path=None, reset_position_ids=False,
                          reset_attention_mask=False, eod_mask_loss=False)
    tok = SimpleNamespace(eod=2, pad=3, vocab_size=8000)
    train, _, _ = build_datasets(cfg, tok, seq_length=64, seed=5, num_samples=(16, 4, 0))
    other = ensure_bundled_dataset(tokenizer_type="SentencePieceTokenizer")
    json.dump({"package": megalite.__file__, "prefix": BUNDLED_PREFIX, "other": other,
               "indices": sorted(train.cache_paths.values())}, sys.stdout)
""")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_installed_copy_run_from_elsewhere_stays_read_only(tmp_path):
    """A copy of the package + data (as a non-editable install would place them), made
    read-only, used from another working directory: nothing new appears in it."""
    src = tmp_path / "site"
    (src / "megalite").mkdir(parents=True)
    shutil.copy(REPO / "megalite" / "__init__.py", src / "megalite")
    shutil.copytree(REPO / "megalite" / "data", src / "megalite" / "data",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "data", src / "data", ignore=shutil.ignore_patterns("cache"))
    for path in [src, *src.rglob("*")]:  # read-only; root ignores that, the listing not
        path.chmod(path.stat().st_mode & ~0o222)
    before = _listing(src)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=str(src), MEGALITE_CACHE_DIR=str(tmp_path / "user"),
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["package"].startswith(str(src))
        assert out["prefix"].startswith(str(src))
        assert _listing(src) == before
        assert out["other"].startswith(str(tmp_path / "user" / "bundled"))
        assert all(p.startswith(str(tmp_path / "user" / "GPTDataset_indices"))
                   and os.path.isfile(p) for p in out["indices"])
        assert os.listdir(elsewhere) == []
    finally:
        for path in [src, *src.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)  # let pytest clean up tmp_path
