#!/usr/bin/env python
"""Write ``reference.json``: the samples Megatron-Core's own datasets draw from the bundled
corpus, which ``tests/data/test_megatron_order.py`` holds megalite's against.

For each case of :data:`CASES` (a single prefix with a split; reset position ids with
the end-of-document loss mask; a weighted blend of two prefixes; a run over several
epochs, whose last is shuffled apart) Megatron-Core's ``BlendedMegatronDatasetBuilder``
builds ``GPTDataset`` splits, and for the first and last :data:`KEEP` samples of each split
the reference keeps a CRC-32 of its ``tokens``, ``labels``, ``loss_mask`` and
``position_ids`` (as int64) and the split's length. The second prefix is the bundled
corpus's documents in reverse order without every third (:func:`second_corpus`), written
with megalite's writer (the ``.bin`` / ``.idx`` layout is Megatron's).

Run in a Megatron-Core environment (see ``tests/checkpoint/megatron/make_fixtures.py`` for
its set-up); CI reads the committed JSON and needs no Megatron::

    /work/mcore-venv/bin/python tests/data/megatron/make_reference.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
BUNDLED = os.path.join(REPO, "data", "kjv_text_document")
SECOND = "{second}"    # stands for second_corpus()'s prefix in a case's data path
EOD = 8002             # the bundled tokenizer's end of document (pad: the same id)
VOCAB = 8004
KEEP = 128
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
CASES = {
    "single": {"data_path": [BUNDLED], "split": "969,30,1", "seq": 64, "seed": 1234,
               "sizes": [300, 40, 10]},
    "reset": {"data_path": [BUNDLED], "split": "98,2,0", "seq": 128, "seed": 7,
              "sizes": [60, 8, 0], "reset_position_ids": True, "eod_mask_loss": True},
    "blend": {"data_path": ["0.3", BUNDLED, "0.7", SECOND], "split": "90,8,2", "seq": 32,
              "seed": 99, "sizes": [400, 30, 10]},
    "epochs": {"data_path": [SECOND], "split": "100,0,0", "seq": 512, "seed": 5,
               "sizes": [5000, 0, 0]},
}


def second_corpus(prefix: str) -> str:
    """The bundled documents in reverse order, every third dropped, written at ``prefix``."""
    sys.path.insert(0, REPO)
    from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

    src = IndexedDataset(BUNDLED)
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for i in reversed(range(len(src))):
            if i % 3:
                w.add_document(np.asarray(src.get(i)))
    return prefix


def data_path(case: dict, second: str) -> list[str]:
    return [second if p == SECOND else p for p in case["data_path"]]


def kept(n: int) -> list[int]:
    """The sample indices a reference keeps of a split of ``n``."""
    return sorted(set(range(min(n, KEEP))) | set(range(max(0, n - KEEP), n)))


def crc(x) -> int:
    return zlib.crc32(np.asarray(x, dtype=np.int64).tobytes())


def main() -> int:
    import types
    import typing

    if not hasattr(typing, "override"):   # megatron-core 0.19.2 on Python 3.11
        typing.override = lambda f: f
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    second = second_corpus(os.path.join(tempfile.mkdtemp(), "second"))
    tok = types.SimpleNamespace(eod=EOD, pad=EOD, vocab_size=VOCAB, unique_identifiers={})
    out = {}
    for name, case in CASES.items():
        cfg = GPTDatasetConfig(
            random_seed=case["seed"], sequence_length=case["seq"],
            blend=get_blend_from_list(data_path(case, second)), split=case["split"],
            path_to_cache=tempfile.mkdtemp(), tokenizer=tok,
            reset_position_ids=case.get("reset_position_ids", False),
            reset_attention_mask=False, eod_mask_loss=case.get("eod_mask_loss", False),
            mid_level_dataset_surplus=0.005, create_attention_mask=False)
        splits = BlendedMegatronDatasetBuilder(GPTDataset, case["sizes"], lambda: True,
                                               cfg).build()
        out[name] = {}
        for i, ds in enumerate(splits):
            if ds is None:
                continue
            rows = {j: ds[j] for j in kept(len(ds))}
            out[name][str(i)] = {"len": len(ds), **{
                f: [crc(rows[j][f]) for j in sorted(rows)] for f in FIELDS}}
    from importlib.metadata import version

    with open(os.path.join(HERE, "reference.json"), "w") as f:
        json.dump({"made_by": "megatron-core " + version("megatron-core"), "keep": KEEP,
                   "cases": out}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
