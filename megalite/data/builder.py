"""Train/valid/test datasets from a :class:`megalite.config.DataConfig`.

Three ways to name the data, as in Megatron-LM:
    --data-path [W1] P1 [W2 P2 ...] + --split 969,30,1   one blend, split by documents
    --train-data-path ... --valid-data-path ... --test-data-path ...   a blend per split
    --mock-data                                           synthetic documents

A single unweighted prefix gives a :class:`GPTDataset` per split. Several prefixes give a
:class:`BlendedDataset` per split whose components each build
``ceil(num_samples * weight * 1.005)`` samples (Megatron's 0.5% margin) and which draws
exactly ``num_samples``. Without weights, components count one epoch each and are blended
by their sizes.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from megalite.data.blended import BlendedDataset
from megalite.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockLowLevelDataset,
)
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.indices import (
    SPLIT_NAMES,
    blend_component_sizes,
    parse_blend,
    parse_split,
    split_documents,
    split_matrix,
)
from megalite.errors import DataError

logger = logging.getLogger(__name__)

Splits = tuple  # (train, valid, test), each a dataset or None


class DataBuildError(DataError, ValueError):
    """Data flags or files that cannot give the requested datasets."""


def build_datasets(data_cfg, tokenizer, seq_length: int, seed: int,
                   num_samples: tuple) -> Splits:
    """(train, valid, test) datasets; a split is None when it is empty or asks for 0 samples.

    ``num_samples`` holds the samples wanted per split (None: one epoch). With
    torch.distributed initialized, rank 0 builds (and caches) the indices first.
    """
    config = GPTDatasetConfig(
        seq_length=seq_length, seed=seed, eod=tokenizer.eod, pad=tokenizer.pad,
        reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss, cache_dir=data_cfg.data_cache_path,
        vocab_size=tokenizer.vocab_size, mmap_bin_files=getattr(data_cfg, "mmap_bin_files", True))
    return run_on_rank_zero_first(lambda: _build_all(data_cfg, config, tuple(num_samples)))


def run_on_rank_zero_first(build):
    """``build()`` on global rank 0, then (once it succeeded) on the other ranks.

    Rank 0 writes the index caches; the others then only load them. A failure on rank 0 is
    reported to every rank instead of leaving them waiting.
    """
    import torch.distributed as dist

    from megalite.parallel.collectives import broadcast_object_list

    if not (dist.is_available() and dist.is_initialized()):
        return build()
    status = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = build()
        except Exception as e:
            status = [f"{type(e).__name__}: {e}"]
            broadcast_object_list(status, src=0)
            raise
    broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise DataBuildError(f"rank 0 failed to build the datasets: {status[0]}")
    return build() if dist.get_rank() != 0 else result


def _build_all(data_cfg, config: GPTDatasetConfig, sizes: tuple) -> Splits:
    sizes = tuple(None if n is None else int(n) for n in sizes) + (None,) * (3 - len(sizes))
    if data_cfg.mock_data:
        return _build_splits(None, split_matrix(parse_split("1,1,1")), sizes, config)
    per_split = [data_cfg.train_data_path, data_cfg.valid_data_path, data_cfg.test_data_path]
    if data_cfg.data_path:
        if any(per_split):
            raise DataBuildError("give either --data-path or --train/valid/test-data-path, "
                                 "not both")
        try:
            blend = parse_blend(data_cfg.data_path)
            matrix = split_matrix(parse_split(data_cfg.split))
        except ValueError as e:
            raise DataBuildError(str(e)) from None
        return _build_blend(blend, matrix, sizes, config, single_prefix_unblended=False)
    if any(per_split):
        out = []
        for i, paths in enumerate(per_split):
            if not paths:
                out.append(None)
                continue
            matrix = [None, None, None]
            matrix[i] = (0.0, 1.0)
            only = [0, 0, 0]
            only[i] = sizes[i]
            try:
                blend = parse_blend(paths)
            except ValueError as e:
                raise DataBuildError(str(e)) from None
            out.append(_build_blend(blend, matrix, tuple(only), config,
                                    single_prefix_unblended=True)[i])
        return tuple(out)
    raise DataBuildError("no training data: pass --data-path PREFIX (or "
                         "--train-data-path ...), or --mock-data")


def _build_blend(blend, matrix, sizes, config, single_prefix_unblended: bool) -> Splits:
    """Datasets per split of a blend; ``single_prefix_unblended``: one prefix is used as is
    even when weighted (Megatron does so for per-split paths, not for --data-path)."""
    prefixes, weights = blend
    if len(prefixes) == 1 and (weights is None or single_prefix_unblended):
        return _build_splits(prefixes[0], matrix, sizes, config)
    if weights is None:
        component_sizes = [(None, None, None)] * len(prefixes)
    else:
        weights = [w / sum(weights) for w in weights]
        per_split = [blend_component_sizes(weights, n) for n in sizes]
        component_sizes = [tuple(None if s is None else s[j] for s in per_split)
                           for j in range(len(prefixes))]
    components = [_build_splits(prefix, matrix, component_sizes[j], config, sizes)
                  for j, prefix in enumerate(prefixes)]
    out = []
    for i in range(3):
        members = [c[i] for c in components]
        if matrix[i] is None or sizes[i] == 0 or any(m is None for m in members):
            out.append(None)
            continue
        if weights is None:
            lengths = [len(m) for m in members]
            size = None if sizes[i] is None else min(sizes[i], sum(lengths))
            out.append(BlendedDataset(members, lengths, size, _blend_cache_dir(config, members)))
        elif sizes[i] is None:
            raise DataBuildError("weighted blends need a sample count for every split")
        else:
            out.append(BlendedDataset(members, weights, sizes[i],
                                      _blend_cache_dir(config, members)))
    return tuple(out)


def _blend_cache_dir(config: GPTDatasetConfig, members) -> str | None:
    if config.cache_dir:
        return config.cache_dir
    paths = getattr(members[0], "cache_paths", None)
    return os.path.dirname(paths["description"]) if paths else None


def _build_splits(prefix: str | None, matrix, sizes, config: GPTDatasetConfig,
                  requested=None) -> Splits:
    """A GPTDataset per split of one prefix (MockGPTDataset when prefix is None).

    ``requested`` are the blend's sample counts (used to decide which splits are wanted).
    """
    requested = sizes if requested is None else requested
    indexed = (IndexedDataset(prefix, mmap=config.mmap_bin_files) if prefix is not None
               else None)
    num_sequences = len(indexed) if indexed is not None else MockLowLevelDataset.size
    if indexed is not None and not np.any(indexed.sequence_lengths):
        raise DataBuildError(f"{prefix}: the dataset holds no tokens ({num_sequences} "
                             "documents); preprocess a non-empty input into it, or leave "
                             "it out of the data paths")
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        if matrix[i] is None or requested[i] == 0:
            out.append(None)
            continue
        documents = split_documents(num_sequences, matrix[i])
        if len(documents) == 0 or (indexed is not None and not np.any(
                indexed.sequence_lengths[documents])):
            message = (f"{prefix}: the {name} split ({matrix[i][0]:.4g}-{matrix[i][1]:.4g} of "
                       f"{num_sequences} documents) holds no tokens; adjust --split")
            if i == 0:
                raise DataBuildError(message)
            logger.warning("%s; no %s dataset", message, name)
            out.append(None)
            continue
        if prefix is None:
            out.append(MockGPTDataset(documents, sizes[i], name, config))
        else:
            out.append(GPTDataset(indexed, prefix, documents, sizes[i], name, config))
    return tuple(out)
