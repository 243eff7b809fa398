"""The data pipeline: tokenizers, the Megatron-compatible ``.bin/.idx`` store, GPT samples,
blending and data-parallel sampling.

    tokenizers.py       build_tokenizer(data_cfg, vocab_size) and the tokenizer classes
    indexed_dataset.py  IndexedDataset (mmap reader), IndexedDatasetWriter, merge_datasets
    preprocess.py       JSONL -> .bin/.idx (tools/preprocess_data.py)
    indices.py          Megatron's document/sample/shuffle/blending index arithmetic
    gpt_dataset.py      GPTDataset, MockGPTDataset (items: tokens, labels, loss_mask, ...)
    blended.py          BlendedDataset
    builder.py          build_datasets(data_cfg, tokenizer, seq_length, seed, num_samples)
    samplers.py         PretrainingSampler, build_data_loader
    bundled.py          ensure_bundled_dataset(), BUNDLED_TOKENIZER_MODEL
    cache_dirs.py       where run-time caches go (the user cache dir, never the source tree)

Submodules are imported on first use, so tools that only tokenize do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "build_datasets": "builder",
    "build_tokenizer": "tokenizers",
    "build_data_loader": "samplers",
    "PretrainingSampler": "samplers",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "BlendedDataset": "blended",
    "IndexedDataset": "indexed_dataset",
    "ensure_bundled_dataset": "bundled",
    "BUNDLED_TOKENIZER_MODEL": "bundled",
    "BUNDLED_TOKENIZER_TYPE": "bundled",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
