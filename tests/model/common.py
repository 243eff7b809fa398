"""Tiny model configurations and helpers shared by the model tests."""

from __future__ import annotations

import torch

from megalite.config import ModelConfig

VOCAB = 50  # padded to 56 at tp=1 and 64 at tp=2/4 (make_vocab_size_divisible_by=8)


def gpt2_config(**overrides) -> ModelConfig:
    kw = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
              "vocab_size": VOCAB, "make_vocab_size_divisible_by": 8, "hidden_dropout": 0.0,
              "attention_dropout": 0.0, "attention_backend": "sdpa"}
    kw.update(overrides)
    return ModelConfig(**kw)


def llama_config(**overrides) -> ModelConfig:
    kw = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
          "group_query_attention": True, "num_query_groups": 4, "ffn_hidden_size": 96,
          "seq_length": 16, "vocab_size": VOCAB,
              "make_vocab_size_divisible_by": 8, "normalization": "RMSNorm", "swiglu": True,
              "position_embedding_type": "rope", "rotary_base": 10000.0, "add_bias_linear": False,
              "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.0,
              "attention_dropout": 0.0, "attention_backend": "sdpa"}
    kw.update(overrides)
    return ModelConfig(**kw)


FAMILIES = {"gpt2": gpt2_config, "llama": llama_config}


def single_process_state():
    from megalite.config import ParallelConfig
    from megalite.parallel.state import ParallelState

    return ParallelState.build(ParallelConfig())


def batch(cfg: ModelConfig, b: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input_ids, labels) ``[b, s]``; labels include an ignored token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, 3] = -100
    return ids[:, :-1].contiguous(), labels
