"""Megatron-LM's saved ``args`` (the ``argparse.Namespace`` in a checkpoint's common
state) <-> megalite's configuration.

Most architecture flags have the same name on both sides (megalite kept Megatron's); the
rest are renamed (``layernorm_epsilon`` -> ``norm_epsilon``, ``layernorm_zero_centered_gamma``
-> ``apply_layernorm_1p``) or are features megalite does not have, which
:func:`unsupported` lists so an import refuses in one line instead of giving other logits.
"""

from __future__ import annotations

from argparse import Namespace

SAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "group_query_attention", "seq_length", "max_position_embeddings",
        "position_embedding_type", "rotary_base", "rotary_percent", "normalization", "swiglu",
        "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
        "add_position_embedding", "make_vocab_size_divisible_by", "init_method_std",
        "hidden_dropout", "attention_dropout", "qk_layernorm")
# multi-latent attention's sizes and YaRN (Megatron-Core's MLA reads its YaRN correction
# range from its config defaults, original context 4096, beta 32 / 1: megalite's defaults)
MLA_SAME = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
            "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor", "mscale",
            "mscale_all_dim")
MOE_SAME = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function",
            "moe_router_topk_scaling_factor", "moe_router_load_balancing_type",
            "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_shared_expert_intermediate_size",
            "moe_router_pre_softmax", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_router_dtype")
TOKENIZER = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "tiktoken_pattern",
             "tiktoken_num_special_tokens", "tiktoken_special_tokens")
NULL_TOKENIZER = "NullTokenizer"


def _get(args: Namespace, name: str, default=None):
    return getattr(args, name, default)


def unsupported(args: Namespace) -> list[str]:
    """What in Megatron's ``args`` megalite's model cannot reproduce (empty: nothing)."""
    a = args
    mla = _get(a, "multi_latent_attention", False)
    checks = [
        (_get(a, "use_legacy_models", False), "a legacy (non-Megatron-Core) model"),
        (_get(a, "rotary_interleaved", False), "--rotary-interleaved"),
        (_get(a, "use_rope_scaling", False), "--use-rope-scaling"),
        (_get(a, "openai_gelu", False), "--openai-gelu (tanh GeLU)"),
        (_get(a, "squared_relu", False), "--squared-relu"),
        (_get(a, "qk_l2_norm", False), "--qk-l2-norm"),
        (mla and _get(a, "rope_type", None) == "rope" and
         (_get(a, "rotary_scaling_factor", 1.0) != 1.0 or _get(a, "rotary_percent", 1.0) != 1.0),
         "multi-latent attention with --rope-type rope and a --rotary-scaling-factor or "
         "--rotary-percent (megalite's is YaRN)"),
        (_get(a, "mla_down_proj_fusion", False), "--mla-down-proj-fusion"),
        (_get(a, "mtp_num_layers", None) and _get(a, "mtp_use_repeated_layer", False),
         "--mtp-use-repeated-layer (one layer shared by the prediction depths)"),
        (_get(a, "heterogeneous_layers_config_path", None), "heterogeneous layers"),
        (_get(a, "position_embedding_type", "learned_absolute") not in
         ("learned_absolute", "rope", "none"),
         f"--position-embedding-type {_get(a, 'position_embedding_type')}"),
        (_get(a, "normalization", "LayerNorm") not in ("LayerNorm", "RMSNorm"),
         f"--normalization {_get(a, 'normalization')}"),
    ]
    if _get(a, "num_experts"):
        checks += [
            (_get(a, "moe_shared_expert_gate", False), "--moe-shared-expert-gate"),
            (_get(a, "moe_latent_size", None), "--moe-latent-size"),
            (_get(a, "moe_router_load_balancing_type", None) == "quantile_balancing",
             "--moe-router-load-balancing-type quantile_balancing"),
            (_get(a, "moe_router_score_function", "softmax") not in ("softmax", "sigmoid"),
             f"--moe-router-score-function {_get(a, 'moe_router_score_function')}"),
        ]
    return [text for bad, text in checks if bad]


def unexportable(model_cfg) -> list[str]:
    """What of megalite's model Megatron-LM would build otherwise from the exported args
    (empty: nothing)."""
    m = model_cfg
    return [text for bad, text in [
        (m.multi_latent_attention and m.original_max_position_embeddings not in (None, 4096),
         f"--original-max-position-embeddings {m.original_max_position_embeddings} "
         "(Megatron-Core's multi-latent attention corrects YaRN for 4096 positions)"),
        (m.mtp_num_layers and m.learned_positions,
         f"--mtp-num-layers {m.mtp_num_layers} with learned absolute position embeddings "
         "(Megatron-LM builds multi-token prediction only with rope or no positions)"),
    ] if bad]


def vocab_size_of(args: Namespace) -> int:
    """The model's vocabulary without Megatron's padding when the args tell it: the
    NullTokenizer's ``--vocab-size`` plus its end-of-document token; otherwise the padded
    size (the tokenizer's own size is not in the args: :func:`megalite.checkpoint.
    megatron.read_megatron` asks the tokenizer files)."""
    padded = _get(args, "padded_vocab_size")
    if _get(args, "tokenizer_type") == NULL_TOKENIZER and _get(args, "vocab_size"):
        return int(args.vocab_size) + 1
    if padded is None:
        raise ValueError("the args record no padded_vocab_size")
    return int(padded)


def model_kwargs(args: Namespace) -> dict:
    """``ModelConfig`` keyword arguments of Megatron's ``args`` (fp32 weights)."""
    kw = {n: getattr(args, n) for n in SAME if _get(args, n) is not None}
    if _get(args, "group_query_attention", False):
        kw["num_query_groups"] = args.num_query_groups
    if kw.get("add_bias_linear", True):
        kw.pop("add_qkv_bias", None)  # Megatron sets it with linear biases: no extra meaning
    eps = _get(args, "norm_epsilon", _get(args, "layernorm_epsilon"))
    if eps is not None:
        kw["norm_epsilon"] = eps
    kw["apply_layernorm_1p"] = bool(_get(args, "apply_layernorm_1p", False)
                                    or _get(args, "layernorm_zero_centered_gamma", False))
    if _get(args, "multi_latent_attention", False):
        kw.update({n: getattr(args, n) for n in MLA_SAME if _get(args, n) is not None})
        kw.pop("kv_channels", None)   # MLA's head dims are its own
        kw["rotary_percent"] = 1.0    # YaRN rotates the whole RoPE part
    if _get(args, "num_experts"):
        kw.update({n: getattr(args, n) for n in MOE_SAME if _get(args, n) is not None})
        if kw.get("moe_router_load_balancing_type") not in ("aux_loss", "seq_aux_loss", "none"):
            kw["moe_router_load_balancing_type"] = "aux_loss"
        freq = _get(args, "moe_layer_freq", 1)
        if freq is not None:
            kw["moe_layer_freq"] = freq   # an int, or the evaluated list
    if _get(args, "mtp_num_layers"):
        kw["mtp_num_layers"] = args.mtp_num_layers
        if _get(args, "mtp_loss_scaling_factor") is not None:
            kw["mtp_loss_scaling_factor"] = args.mtp_loss_scaling_factor
    kw["bf16"], kw["fp16"] = bool(_get(args, "bf16", False)), bool(_get(args, "fp16", False))
    if _get(args, "transformer_impl") in ("transformer_engine", "local"):
        kw["transformer_impl"] = args.transformer_impl   # an export writes its names
    kw["vocab_size"] = vocab_size_of(args)
    return kw


# the optimizer and schedule flags (the same names on both sides) a resumed run continues
OPTIM_SAME = ("optimizer", "lr", "min_lr", "lr_decay_style", "lr_decay_iters",
              "lr_decay_samples", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
              "lr_warmup_init", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
              "sgd_momentum", "clip_grad", "loss_scale", "initial_loss_scale", "min_loss_scale",
              "loss_scale_window", "hysteresis")
TRAIN_SAME = ("micro_batch_size", "global_batch_size", "train_iters", "train_samples", "seed")


def run_args(cfg) -> dict:
    """The optimizer, schedule, loss-scale and batch flags of megalite's run ``cfg`` under
    Megatron-LM's names (:data:`OPTIM_SAME`, :data:`TRAIN_SAME`, the Lion betas, the loss
    normalisation): what an export with the optimizer state records in ``args``, so that
    its import (or Megatron-LM's) resumes the same run."""
    o, t = cfg.optim, cfg.train
    kw = {n: getattr(o, n) for n in OPTIM_SAME}
    kw.update({n: getattr(t, n) for n in TRAIN_SAME})
    kw.update(lion_beta1=o.lion_beta1, lion_beta2=o.lion_beta2,
              calculate_per_token_loss=not t.per_microbatch_loss)
    return kw


def optim_kwargs(args: Namespace, lion_betas: tuple[float, float] | None = None) -> dict:
    """``OptimConfig`` settings of the Megatron run (what its optimizer state was made
    with; Megatron's ``adam`` is AdamW, as megalite's). A Lion run's betas are
    ``lion_betas``, those its saved Lion groups hold, where given (Megatron-Core 0.19.2's
    --optimizer lion steps with --adam-beta1/2), else its --lion-beta1/2."""
    kw = {n: getattr(args, n) for n in OPTIM_SAME if _get(args, n) is not None}
    if kw.get("optimizer") not in ("adam", "sgd", "lion"):   # another's state is not
        kw.pop("optimizer", None)                              # imported
    if kw.get("optimizer") == "lion":
        betas = lion_betas or (_get(args, "lion_beta1", 0.95), _get(args, "lion_beta2", 0.98))
        kw["lion_beta1"], kw["lion_beta2"] = (float(b) for b in betas)
    return kw


def train_kwargs(args: Namespace) -> dict:
    """``TrainConfig`` settings of the Megatron run (batch sizes, length, seed, and its
    loss normalisation: Megatron's default, the mean of per-micro-batch means, is
    megalite's ``--per-microbatch-loss``)."""
    kw = {n: getattr(args, n) for n in TRAIN_SAME if _get(args, n) is not None}
    kw["per_microbatch_loss"] = not _get(args, "calculate_per_token_loss", False)
    return kw


def parallel_kwargs(args: Namespace) -> dict:
    """``ParallelConfig`` settings of the Megatron run that its checkpoint depends on:
    whether it sharded its optimizer (the format an export back writes); its sizes are
    not kept, the megalite checkpoint being layout-free."""
    return {"use_distributed_optimizer": bool(_get(args, "use_distributed_optimizer", False))}


def data_kwargs(args: Namespace) -> dict:
    """``DataConfig`` tokenizer settings recorded in ``args``."""
    return {n: getattr(args, n) for n in TOKENIZER if _get(args, n) is not None}


def megatron_args(cfg, tp: int = 1, pp: int = 1, impl: str = "transformer_engine"
                  ) -> Namespace:
    """A Megatron-LM ``args`` namespace for megalite's ``cfg`` (what an exported
    checkpoint's common state carries: the architecture, tokenizer and layout flags
    Megatron checks and reads back with ``--use-checkpoint-args``; ``impl`` the
    ``--transformer-impl`` whose names the tensors carry)."""
    m = cfg.model
    kw = {n: getattr(m, n) for n in SAME}
    kw.update(num_query_groups=m.num_query_groups if m.group_query_attention else 1,
              add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,  # as Megatron's parser sets
              layernorm_epsilon=m.norm_epsilon, norm_epsilon=m.norm_epsilon,
              apply_layernorm_1p=m.apply_layernorm_1p,
              layernorm_zero_centered_gamma=m.apply_layernorm_1p,
              padded_vocab_size=m.padded_vocab_size(tp),
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              rotary_interleaved=False, openai_gelu=False, squared_relu=False,
              qk_layernorm=m.qk_layernorm, qk_l2_norm=False,
              multi_latent_attention=m.multi_latent_attention,
              mtp_num_layers=m.mtp_num_layers or None,
              mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
              mtp_use_repeated_layer=False, transformer_impl=impl,
              use_legacy_models=False, bf16=m.bf16, fp16=m.fp16,
              data_parallel_random_init=False,
              num_experts=m.num_experts)
    if m.multi_latent_attention:
        kw.update({n: getattr(m, n) for n in MLA_SAME})
        kw.update(rope_type="yarn", mla_down_proj_fusion=False,
                  yarn_original_max_position_embeddings=m.original_max_position_embeddings)
    if m.num_experts:
        kw.update({n: getattr(m, n) for n in MOE_SAME})
        kw.update(moe_layer_freq=(m.moe_layer_freq if isinstance(m.moe_layer_freq, int)
                                  else [int(f) for f in m.moe_layer_pattern]),
                  moe_shared_expert_gate=False, moe_latent_size=None,
                  moe_grouped_gemm=False, expert_model_parallel_size=1)
    d = cfg.data
    kw.update({n: getattr(d, n, None) for n in TOKENIZER})
    kw["vocab_size"] = (m.vocab_size - 1 if d.tokenizer_type == NULL_TOKENIZER else None)
    return Namespace(**kw)
