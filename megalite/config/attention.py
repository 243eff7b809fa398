"""Attention variants' flags: multi-latent attention's sizes and QK-clip, the checks.

The layers are :mod:`megalite.transformer` (MLA, :mod:`megalite.transformer.max_logits`
for QK-clip); here only what the flags may be and what they may be combined with.
"""

from __future__ import annotations

from megalite.config.fields import positive, require


def check_attention_variant(m) -> None:
    """Multi-latent attention's sizes (Megatron's defaults where unset, set on ``m``, a
    ModelConfig) and the flags that only it reads."""
    mla_only = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim", "original_max_position_embeddings")
    positive(m, *mla_only, "rotary_scaling_factor")
    if not m.multi_latent_attention:
        for name in mla_only:
            require(getattr(m, name) is None,
                    f"--{name.replace('_', '-')} needs --multi-latent-attention")
        for name, default in (("rotary_scaling_factor", 1.0), ("mscale", 1.0),
                              ("mscale_all_dim", 0.0)):
            require(getattr(m, name) == default,
                    f"--{name.replace('_', '-')} ({getattr(m, name)}) is YaRN's, which "
                    "megalite implements for --multi-latent-attention only")
        return
    require(not m.group_query_attention,
            "--multi-latent-attention and --group-query-attention cannot be combined: "
            "multi-latent attention has one key/value head per query head")
    for name, default in (("kv_lora_rank", 32), ("qk_head_dim", 128),
                          ("qk_pos_emb_head_dim", 64), ("v_head_dim", 128),
                          ("original_max_position_embeddings", 4096)):
        if getattr(m, name) is None:
            setattr(m, name, default)
    require(m.qk_pos_emb_head_dim % 2 == 0,
            f"--qk-pos-emb-head-dim ({m.qk_pos_emb_head_dim}) must be even: RoPE "
            "rotates pairs of channels")
    require(m.rotary_percent == 1.0,
            f"--rotary-percent ({m.rotary_percent}) does not apply to multi-latent "
            "attention, whose RoPE part is --qk-pos-emb-head-dim; leave it at 1.0")
    for name in ("mscale", "mscale_all_dim"):
        require(getattr(m, name) >= 0, f"--{name.replace('_', '-')} must be >= 0")


def check_qk_clip(m) -> None:
    """QK-clip's constants (Megatron's bounds), and the query/key layouts it knows; ``m`` a
    ModelConfig."""
    if not m.qk_clip:
        for name, default in (("qk_clip_threshold", 100.0), ("qk_clip_alpha", 0.5)):
            require(getattr(m, name) == default,
                    f"--{name.replace('_', '-')} ({getattr(m, name)}) needs --qk-clip")
        return
    require(0.0 < m.qk_clip_alpha < 1.0,
            f"--qk-clip-alpha must be between 0 and 1 (exclusive), got "
            f"{m.qk_clip_alpha}")
    require(m.qk_clip_threshold > 0,
            f"--qk-clip-threshold must be > 0, got {m.qk_clip_threshold}")
    require(m.multi_latent_attention or not m.qk_layernorm,
            "--qk-clip scales the query/key projection weights, which --qk-layernorm "
            "normalizes away after them (the logits would not move); drop one of the two "
            "(with --multi-latent-attention the norms sit on the latents and QK-clip "
            "works)")
