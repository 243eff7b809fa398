"""What the checkpoint conversions (``convert_checkpoint.py``, ``convert_megatron.py``)
share: their error, their progress counter, and the ``pretrain_gpt.py`` flags they print
for a converted model."""

from __future__ import annotations

import dataclasses
import shlex

from megalite.config import MegaliteConfig
from megalite.errors import EXIT_CHECKPOINT, KnownError


class ConversionError(KnownError, ValueError):
    """A source that cannot be converted (not a checkpoint of the named kind, tensors
    without a counterpart): one line, exit code 4 like every checkpoint error."""

    exit_code = EXIT_CHECKPOINT


def progress(items, desc: str, unit: str):
    """``items`` counted on stderr (megalite.progress: a bar on a terminal, a line every
    10% or 30 s in a log, nothing in the first 2 s); the steps of a conversion when
    ``items`` is an int."""
    from megalite.progress import Progress

    if isinstance(items, int):
        return Progress(items, desc, unit)
    return Progress(desc=desc, unit=unit, iterable=items)


# -- flags -------------------------------------------------------------------------------------
ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "group_query_attention", "num_query_groups", "seq_length",
                "max_position_embeddings", "position_embedding_type", "rotary_base",
                "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias",
                "untie_embeddings_and_output_weights", "apply_layernorm_1p",
                "add_position_embedding", "num_experts", "moe_router_topk",
                "moe_ffn_hidden_size")
MOE_ONLY = ("moe_router_topk", "moe_ffn_hidden_size")
# printed where they differ from the flag's default (DeepSeek-V3's attention and routing)
UNLESS_DEFAULT = ("multi_latent_attention", "qk_layernorm", "q_lora_rank", "kv_lora_rank",
                  "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
                  "mscale", "mscale_all_dim", "original_max_position_embeddings",
                  "moe_layer_freq", "moe_shared_expert_intermediate_size",
                  "moe_router_score_function", "moe_router_topk_scaling_factor",
                  "moe_router_num_groups", "moe_router_group_topk", "mtp_num_layers",
                  "mtp_loss_scaling_factor",
                  "moe_router_enable_expert_bias", "moe_router_dtype",
                  "moe_router_load_balancing_type", "moe_router_pre_softmax")


def training_flags(cfg: MegaliteConfig) -> list[str]:
    """``pretrain_gpt.py`` flags that rebuild this architecture, plus the target tensor /
    pipeline parallel sizes (the vocabulary comes from the tokenizer)."""
    from megalite.arguments import flag_of

    fields = {f.name: f for f in dataclasses.fields(cfg.model)}
    argv = []
    for name in ARCHITECTURE + UNLESS_DEFAULT:
        value, f = getattr(cfg.model, name), fields[name]
        if name in UNLESS_DEFAULT and value == f.default:
            continue
        if name == "num_query_groups" and not cfg.model.group_query_attention:
            continue
        if name == "rotary_base" and cfg.model.position_embedding_type != "rope":
            continue
        if name in MOE_ONLY and cfg.model.num_experts is None:
            continue
        if isinstance(value, bool):
            if value != (f.metadata.get("action") == "store_false"):
                argv.append(flag_of(f))   # store_true when True, store_false when False
        elif value is not None:
            argv += [flag_of(f), shlex.quote(str(value))]  # "[0]*3+[1]*5" is a glob
    p = cfg.parallel
    return argv + ["--tensor-model-parallel-size", str(p.tensor_model_parallel_size),
                   "--pipeline-model-parallel-size", str(p.pipeline_model_parallel_size)]


def tokenizer_flags(cfg: MegaliteConfig) -> list[str]:
    """The tokenizer flags the source recorded (NullTokenizer: its --vocab-size)."""
    d, argv = cfg.data, []
    if d.tokenizer_type:
        argv += ["--tokenizer-type", d.tokenizer_type]
    if d.tokenizer_type == "NullTokenizer":
        argv += ["--vocab-size", str(cfg.model.vocab_size - 1)]
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(d, name):
            argv += ["--" + name.replace("_", "-"), getattr(d, name)]
    return argv
