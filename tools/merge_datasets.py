#!/usr/bin/env python
"""Concatenate several ``.bin/.idx`` datasets into one.

    python tools/merge_datasets.py --input DIR_OR_PREFIX [...] --output-prefix out/merged

Each ``--input`` is a dataset prefix or a directory whose ``*.idx``/``*.bin`` pairs are all
merged (in sorted order). All inputs must share the token dtype. The output is written under
temporary names and renamed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.data.indexed_dataset import IndexedDatasetError, exists, merge_datasets


def expand_inputs(inputs) -> list[str]:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(str(p)[:-4] for p in Path(item).glob("*.idx"))
            found = [p for p in found if exists(p)]
            if not found:
                raise IndexedDatasetError(f"{item}: no .bin/.idx pairs in this directory")
            prefixes.extend(found)
        else:
            prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
            if not exists(prefix):
                raise IndexedDatasetError(f"{prefix}: no {prefix}.bin/.idx pair")
            prefixes.append(prefix)
    return prefixes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--input", nargs="+", required=True,
                   help="Dataset prefixes or directories of datasets.")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes = expand_inputs(args.input)
        merged = merge_datasets(prefixes, args.output_prefix)
    except IndexedDatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets: {merged.num_documents} documents, "
          f"{merged.num_tokens} tokens -> {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
