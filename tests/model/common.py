"""Tiny model configurations and helpers shared by the model tests."""

from __future__ import annotations

import torch

from megalite.config import ModelConfig
from megalite.models.families import get_family

VOCAB = 50  # padded to 56 at tp=1 and 64 at tp=2/4 (make_vocab_size_divisible_by=8)
TINY = {"seq_length": 16, "vocab_size": VOCAB, "make_vocab_size_divisible_by": 8,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "attention_backend": "sdpa"}


def tiny_config(family: str, sizes: dict, overrides: dict) -> ModelConfig:
    """The family's defaults (its spec's) + the tiny run settings + ``sizes`` + overrides."""
    return ModelConfig(**{**get_family(family).defaults, **TINY, **sizes, **overrides})


def gpt2_config(**overrides) -> ModelConfig:
    return tiny_config("gpt2", {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4},
                       overrides)


def llama_config(**overrides) -> ModelConfig:
    """GQA (8 heads, 4 groups), untied, RoPE base 10000."""
    return tiny_config("llama", {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
                                 "group_query_attention": True, "num_query_groups": 4,
                                 "ffn_hidden_size": 96}, overrides)


def mixtral_config(**overrides) -> ModelConfig:
    """Llama's settings plus 4 experts with softmax top-2 routing."""
    return tiny_config("mixtral", {"num_layers": 2, "hidden_size": 32,
                                   "num_attention_heads": 4, "group_query_attention": True,
                                   "num_query_groups": 2, "ffn_hidden_size": 24,
                                   "num_experts": 4, "moe_router_topk": 2}, overrides)


def deepseek_v3_config(**overrides) -> ModelConfig:
    """Multi-latent attention (latents 12 / 16, heads 8 + 4 RoPE / 6), one dense layer then
    MoE: 8 experts top-4 in 4 groups (2 per token), sigmoid + expert bias, 1 shared."""
    return tiny_config("deepseek_v3", {
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 48,
        "q_lora_rank": 12, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
        "v_head_dim": 6, "num_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 16, "moe_layer_freq": "[0]*1+[1]*1",
        "moe_router_num_groups": 4, "moe_router_group_topk": 2,
        "moe_router_topk_scaling_factor": 2.5}, overrides)


FAMILIES = {"gpt2": gpt2_config, "llama": llama_config}  # the dense ones; mixtral on its own


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
