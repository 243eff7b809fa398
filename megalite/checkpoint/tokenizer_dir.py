"""The tokenizer a checkpoint carries: ``SAVE/tokenizer/``, beside the iterations.

::

    SAVE/
      latest_checkpointed_iteration.txt
      iter_0000000/ ...
      tokenizer/                  Hugging Face tokenizer files (tokenizer.json,
                                  tokenizer_config.json, special_tokens_map.json,
                                  tokenizer.model, vocab/merges ...), as the source had them

A checkpoint converted from Hugging Face carries its source's tokenizer there. Whoever
loads the checkpoint without naming a tokenizer (generate, evaluate, the server, training
with ``--load``) uses it as ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model
SAVE/tokenizer`` (:func:`use_carried_tokenizer`); tokenizer flags, or a tokenizer the
checkpoint's config records, win over it.
"""

from __future__ import annotations

import os
import shutil

from megalite.checkpoint.files import CheckpointError, fsync_path
from megalite.data.tokenizer_export import HF_TOKENIZER_FILES

TOKENIZER_DIR = "tokenizer"
# a tokenizer needs at least one of these (the rest only configure it)
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def tokenizer_files(directory: str) -> list[str]:
    """Names of the tokenizer files in ``directory``; empty unless one of them holds a
    vocabulary."""
    if not os.path.isdir(directory):
        return []
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    return names if any(n in _VOCABULARY_FILES for n in names) else []


def carried_tokenizer(root: str) -> str | None:
    """``root/tokenizer`` when the checkpoint under ``root`` carries a tokenizer."""
    path = os.path.join(root, TOKENIZER_DIR)
    return path if tokenizer_files(path) else None


def write_tokenizer_dir(root: str, source: str) -> list[str]:
    """Copy the tokenizer files of the directory ``source`` to ``root/tokenizer`` (copied
    into a temporary directory, fsynced, then renamed into place, replacing an older
    one); the names copied."""
    names = tokenizer_files(source)
    if not names:
        raise CheckpointError(f"{source} holds no tokenizer files (one of "
                              f"{', '.join(_VOCABULARY_FILES)})")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, TOKENIZER_DIR)
    tmp, old = f"{final}.tmp{os.getpid()}", f"{final}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(tmp, name))
        fsync_path(os.path.join(tmp, name))
    fsync_path(tmp)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(root)
    shutil.rmtree(old, ignore_errors=True)
    return names


def use_carried_tokenizer(data_cfg, root: str | None, replace_missing: bool = False
                          ) -> str | None:
    """Point ``data_cfg`` at the tokenizer the checkpoint under ``root`` carries when it
    names none of its own (no ``--tokenizer-type``, or HuggingFaceTokenizer without
    ``--tokenizer-model``; mock data's NullTokenizer is a tokenizer) or, with
    ``replace_missing`` (a checkpoint's recorded settings), a HuggingFaceTokenizer directory
    that is gone (moved with the checkpoint); the path used, or None when ``data_cfg`` is
    left as it was."""
    if root is None or data_cfg.vocab_file:
        return None
    kind, model = data_cfg.tokenizer_type, data_cfg.tokenizer_model
    if kind not in (None, "HuggingFaceTokenizer") or (kind is None and data_cfg.mock_data):
        return None
    if model is not None and not (replace_missing and kind == "HuggingFaceTokenizer"
                                  and not os.path.exists(model)):
        return None
    path = carried_tokenizer(root)
    if path is not None:
        data_cfg.tokenizer_type, data_cfg.tokenizer_model = "HuggingFaceTokenizer", path
    return path


def carry_training_tokenizer(data_cfg, root: str) -> str | None:
    """Copy the tokenizer a run uses into its ``--save`` directory ``root`` (rank 0, once
    at start-up), so its checkpoints carry it: a HuggingFaceTokenizer directory only (the
    other types' files have no Hugging Face form here, and their flags are recorded); the
    path written, None when nothing is to be done."""
    source = data_cfg.tokenizer_model
    if (data_cfg.tokenizer_type != "HuggingFaceTokenizer" or not source
            or not tokenizer_files(source)):
        return None
    target = os.path.join(root, TOKENIZER_DIR)
    if os.path.realpath(source) == os.path.realpath(target):
        return None
    write_tokenizer_dir(root, source)
    return target
