"""A weighted mixture of datasets (``--data-path 0.3 prefixA 0.7 prefixB``).

Sample i of the blend is sample ``dataset_sample_index[i]`` of dataset
``dataset_index[i]``; the two arrays come from Megatron's greedy rule (see
:func:`megalite.data.indices.build_blending_indices`), so the counts follow the weights as
closely as possible at every prefix of the blend. They are cached like the GPT indices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from megalite.data.indices import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    normalize,
)

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples mixed from ``datasets`` in proportion to ``weights``.

    weights are normalized here. ``size=None`` takes every sample of every dataset exactly
    once (weights are then the dataset lengths). ``cache_dir=None`` keeps the indices in
    memory only.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int | None,
                 cache_dir: str | None = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        self.description = {
            "class": type(self).__name__,
            "datasets": [getattr(d, "description", type(d).__name__) for d in self.datasets],
            "weights": self.weights,
            "size": size,
        }
        self.description_hash = hashlib.md5(
            json.dumps(self.description, indent=2).encode()).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir)
        self._check_bounds()

    def _load_or_build(self, cache_dir: str | None):
        paths = None
        if cache_dir:
            base = os.path.join(cache_dir, f"{self.description_hash}-{type(self).__name__}")
            paths = {"dataset_index": f"{base}-dataset_index.npy",
                     "dataset_sample_index": f"{base}-dataset_sample_index.npy",
                     "description": f"{base}-description.json"}
            if all(os.path.isfile(p) for p in paths.values()):
                return (np.load(paths["dataset_index"], mmap_mode="r"),
                        np.load(paths["dataset_sample_index"], mmap_mode="r"))
        start = time.time()
        if self.size is None:
            arrays = build_exhaustive_blending_indices([len(d) for d in self.datasets])
        else:
            arrays = build_blending_indices(self.weights, self.size)
        logger.info("built blending indices for %d samples of %d datasets in %.2fs",
                    len(arrays[0]), len(self.datasets), time.time() - start)
        if paths:
            from megalite.data.gpt_dataset import save_atomically

            save_atomically(paths, {"dataset_index": arrays[0],
                                    "dataset_sample_index": arrays[1]}, self.description)
        return arrays

    def _check_bounds(self) -> None:
        for k, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[np.asarray(self.dataset_index) == k]
            if len(used) and int(used.max()) >= len(dataset):
                raise ValueError(f"blend component {k} has {len(dataset)} samples but the "
                                 f"blend needs {int(used.max()) + 1}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
