"""Typed configuration for megalite.

Every setting is a field of one of the section dataclasses below. The field name is the
Megatron-LM flag name with dashes turned into underscores (``tensor_model_parallel_size``
is ``--tensor-model-parallel-size``); ``megalite.arguments`` generates the command line
from these fields, so a flag is declared exactly once, here.

Validation that concerns one section lives in that section's ``__post_init__``; checks that
relate sections (heads vs tensor parallel size, batch sizes vs data parallel size, world size
vs the parallel layout) live in :meth:`MegaliteConfig.validate`. Every problem raises
:class:`ConfigError` with one sentence that names the values and how to fix them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value (or combination of values) that cannot work."""


def arg(default: Any = None, help: str = "", *, flag: str | None = None,
        action: str | None = None, choices: tuple | None = None,
        nargs: str | None = None, aliases: tuple = (), cli: bool = True):
    """A dataclass field carrying its command-line description.

    flag:    the CLI flag when it differs from ``--field-name`` (e.g. ``--disable-bias-linear``
             for ``add_bias_linear``).
    action:  ``store_true`` / ``store_false`` for booleans (defaults: store_true when the
             default is False).
    aliases: extra flag spellings accepted for the same field.
    cli:     False for derived fields that are not flags.
    """
    meta = dict(help=help, flag=flag, action=action, choices=choices, nargs=nargs,
                aliases=tuple(aliases), cli=cli)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_choices(obj: Any) -> None:
    """Every field declared with ``choices`` holds one of them (None allowed when default)."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices and value not in choices and not (value is None and f.default is None):
            raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; "
                              f"got {value!r}")


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            _require(value > 0, f"{name} must be positive, got {value}")


# ----------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    num_layers: int = arg(2, "Number of transformer layers.")
    hidden_size: int = arg(64, "Transformer hidden size.")
    ffn_hidden_size: int | None = arg(None, "MLP hidden size (default 4 x hidden).")
    num_attention_heads: int = arg(4, "Number of attention heads.")
    kv_channels: int | None = arg(None, "Head dimension (default hidden/heads).")
    group_query_attention: bool = arg(False, "Use grouped-query attention.")
    num_query_groups: int | None = arg(None, "Number of key/value groups under GQA.")
    seq_length: int = arg(128, "Sequence length of a training sample.")
    max_position_embeddings: int | None = arg(None, "Size of the learned position table "
                                                 "(default seq_length).")
    position_embedding_type: str = arg("learned_absolute", "Position embedding kind.",
                                       choices=("learned_absolute", "rope", "none"))
    rotary_base: float = arg(10000.0, "RoPE base frequency.")
    rotary_percent: float = arg(1.0, "Fraction of the head dimension that RoPE rotates.")
    normalization: str = arg("LayerNorm", "Normalization layer.",
                             choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "Epsilon of the normalization layers.")
    swiglu: bool = arg(False, "Use SwiGLU in the MLP (Llama).")
    add_bias_linear: bool = arg(True, "Disable biases in the linear layers.",
                                flag="--disable-bias-linear", action="store_false")
    add_qkv_bias: bool = arg(False, "Add a bias to the QKV projection even when "
                             "--disable-bias-linear is set.")
    untie_embeddings_and_output_weights: bool = arg(False, "Separate input embedding and "
                                                    "output layer weights.")
    hidden_dropout: float = arg(0.1, "Dropout on the residual branch outputs.")
    attention_dropout: float = arg(0.1, "Dropout on the attention probabilities.")
    init_method_std: float = arg(0.02, "Std of the normal initialization.")
    vocab_size: int | None = arg(None, "Vocabulary size (NullTokenizer); otherwise set "
                                    "from the tokenizer.")
    make_vocab_size_divisible_by: int = arg(128, "Pad the vocabulary to a multiple of this "
                                            "times the tensor parallel size.")
    attention_backend: str = arg("auto", "Attention implementation.",
                                 choices=("auto", "flash", "sdpa", "local"))
    recompute_granularity: str | None = arg(None, "Activation recomputation.",
                                               choices=("full", "selective"))
    recompute_method: str | None = arg(None, "Which layers full recomputation covers.",
                                          choices=("uniform", "block"))
    recompute_num_layers: int | None = arg(None, "Layers per recompute unit (uniform) or "
                                              "recomputed layers per stage (block).")
    bf16: bool = arg(False, "Train in bfloat16 with fp32 master weights.")
    fp16: bool = arg(False, "Train in float16 with dynamic loss scaling.")
    # Mixture of experts
    num_experts: int | None = arg(None, "Number of experts (MoE when set).")
    moe_router_topk: int = arg(2, "Experts per token.")
    moe_ffn_hidden_size: int | None = arg(None, "Expert MLP hidden size (default ffn).")
    moe_layer_freq: int = arg(1, "Every n-th layer is an MoE layer.")
    moe_shared_expert_intermediate_size: int | None = arg(None, "Shared expert size.")
    moe_router_score_function: str = arg("softmax", "Router score function.",
                                         choices=("softmax", "sigmoid"))
    moe_router_topk_scaling_factor: float | None = arg(None, "Scale of top-k scores.")
    moe_router_load_balancing_type: str = arg("aux_loss", "Load-balancing loss.",
                                              choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = arg(0.0, "Coefficient of the aux loss.")
    moe_z_loss_coeff: float | None = arg(None, "Coefficient of the router z-loss.")
    moe_expert_capacity_factor: float | None = arg(None, "Capacity factor (dropless "
                                                      "when unset).")
    moe_token_drop_policy: str = arg("probs", "Which tokens to drop over capacity.",
                                     choices=("probs", "position"))
    moe_pad_expert_input_to_capacity: bool = arg(False, "Pad expert inputs to capacity.")
    moe_token_dispatcher_type: str = arg("alltoall", "Token dispatcher.",
                                         choices=("alltoall", "allgather"))

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                  "ffn_hidden_size", "kv_channels", "num_query_groups",
                  "make_vocab_size_divisible_by", "vocab_size", "init_method_std",
                  "norm_epsilon", "rotary_base", "num_experts", "moe_router_topk",
                  "moe_layer_freq")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"hidden_size ({self.hidden_size}) must be divisible by "
                     f"num_attention_heads ({self.num_attention_heads}), or set --kv-channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention:
            _require(self.num_query_groups in (None, self.num_attention_heads),
                     f"--num-query-groups ({self.num_query_groups}) needs "
                     "--group-query-attention")
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        _require(self.num_attention_heads % self.num_query_groups == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                 f"num_query_groups ({self.num_query_groups})")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.position_embedding_type == "learned_absolute":
            _require(self.max_position_embeddings >= self.seq_length,
                     f"max_position_embeddings ({self.max_position_embeddings}) must be >= "
                     f"seq_length ({self.seq_length}) with learned absolute positions")
        _require(0.0 < self.rotary_percent <= 1.0,
                 f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _require(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value}")
        _require(not (self.bf16 and self.fp16), "--bf16 and --fp16 cannot both be set")
        if self.recompute_method is not None:
            _require(self.recompute_granularity == "full",
                     "--recompute-method needs --recompute-granularity full")
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                self.recompute_method = "uniform"
            if self.recompute_num_layers is None:
                self.recompute_num_layers = 1
        if self.num_experts is not None:
            _require(self.moe_router_topk <= self.num_experts,
                     f"moe_router_topk ({self.moe_router_topk}) must be <= num_experts "
                     f"({self.num_experts})")
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
        _positive(self, "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
        if self.moe_router_topk_scaling_factor is not None:
            _require(self.moe_router_topk_scaling_factor > 0,
                     f"moe_router_topk_scaling_factor must be positive, got "
                     f"{self.moe_router_topk_scaling_factor}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"{name} must be >= 0, got {value}")
        if self.moe_expert_capacity_factor is not None:
            _require(self.moe_expert_capacity_factor > 0,
                     "moe_expert_capacity_factor must be positive")
        if self.moe_pad_expert_input_to_capacity:
            _require(self.moe_expert_capacity_factor is not None,
                     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")

    @property
    def params_dtype_name(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    def check_layout(self, tp: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        """What the model needs from a layout's sizes; the one place these rules live
        (``MegaliteConfig.validate`` and the model builders call it)."""
        etp = tp if etp is None else etp
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            _require(getattr(self, name) % tp == 0,
                     f"{name} ({getattr(self, name)}) must be divisible by "
                     f"tensor_model_parallel_size ({tp})")
        if self.num_experts is None:
            return
        _require(self.num_experts % ep == 0,
                 f"num_experts ({self.num_experts}) must be divisible by "
                 f"expert_model_parallel_size ({ep})")
        if tp > 1:  # the MoE layer splits the sequence over tp, with or without SP
            _require(self.seq_length % (tp * cp) == 0,
                     f"seq_length ({self.seq_length}) must be divisible by "
                     f"tensor_model_parallel_size ({tp}) x context_parallel_size ({cp}) "
                     f"with --num-experts (MoE layers split the sequence over tp)")
        _require(self.moe_ffn_hidden_size % etp == 0,
                 f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be divisible by "
                 f"expert_tensor_parallel_size ({etp})")
        if self.add_bias_linear:
            _require(etp in (1, tp),
                     f"expert biases need expert_tensor_parallel_size ({etp}) equal to 1 or "
                     f"to tensor_model_parallel_size ({tp}); or pass --disable-bias-linear")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None:
            _require(shared % tp == 0,
                     f"moe_shared_expert_intermediate_size ({shared}) must be divisible by "
                     f"tensor_model_parallel_size ({tp})")

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp."""
        _require(self.vocab_size is not None, "vocab_size is unknown: pass --vocab-size or "
                 "a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple


# ----------------------------------------------------------------------------------------
# Parallelism
# ----------------------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = arg(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = arg(1, "Pipeline model parallel size.")
    virtual_pipeline_model_parallel_size: int | None = arg(
        None, "Model chunks per pipeline rank (interleaved 1F1B).")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "Layers per virtual pipeline stage (sets the virtual size).")
    decoder_first_pipeline_num_layers: int | None = arg(None, "Layers on the first stage.")
    decoder_last_pipeline_num_layers: int | None = arg(None, "Layers on the last stage.")
    sequence_parallel: bool = arg(False, "Shard norms/dropout activations along the sequence "
                                  "over the tensor parallel group.")
    context_parallel_size: int = arg(1, "Context parallel size.")
    expert_model_parallel_size: int = arg(1, "Expert model parallel size.")
    expert_tensor_parallel_size: int | None = arg(None, "Tensor parallel size of the "
                                                     "experts (default: tp).")
    use_distributed_optimizer: bool = arg(False, "Shard optimizer state over data parallel.")
    overlap_grad_reduce: bool = arg(False, "Overlap gradient reduction with backward.")
    overlap_param_gather: bool = arg(False, "Overlap the parameter all-gather with forward.")
    ddp_bucket_size: int | None = arg(None, "Gradient bucket size in elements.")
    grad_reduce_in_bf16: bool = arg(False, "Reduce gradients in bfloat16.")
    distributed_backend: str = arg("auto", "Process group backend (auto: nccl on GPU, "
                                   "gloo otherwise).", choices=("auto", "nccl", "gloo"))
    distributed_timeout_minutes: int = arg(10, "Timeout of collectives.")
    variable_seq_lengths: bool = arg(False, "Exchange shapes before pipeline transfers.")

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "context_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size", "distributed_timeout_minutes",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        if self.ddp_bucket_size is not None:
            _require(self.ddp_bucket_size > 0,
                     f"--ddp-bucket-size must be > 0, got {self.ddp_bucket_size}")
        if self.overlap_param_gather:
            _require(self.use_distributed_optimizer,
                     "--overlap-param-gather needs --use-distributed-optimizer")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron silently turns it off; so do we (it is a no-op at tp=1).
            self.sequence_parallel = False
        _require(self.virtual_pipeline_model_parallel_size is None
                 or self.num_layers_per_virtual_pipeline_stage is None,
                 "give either --virtual-pipeline-model-parallel-size or "
                 "--num-layers-per-virtual-pipeline-stage, not both")
        vpp = (self.virtual_pipeline_model_parallel_size
               or self.num_layers_per_virtual_pipeline_stage)
        if vpp is not None:
            _require(self.pipeline_model_parallel_size > 1,
                     "virtual pipeline stages need --pipeline-model-parallel-size > 1")

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.model_parallel_size
        _require(world_size % mp == 0,
                 f"world size ({world_size}) must be divisible by tensor_model_parallel_size "
                 f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                 f"({self.pipeline_model_parallel_size}) x context_parallel_size "
                 f"({self.context_parallel_size}) = {mp}")
        return world_size // mp


# ----------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# ----------------------------------------------------------------------------------------
@dataclass
class OptimConfig:
    optimizer: str = arg("adam", "Optimizer (adam is AdamW).", choices=("adam", "sgd"))
    lr: float = arg(1e-4, "Peak learning rate.")
    min_lr: float = arg(0.0, "Minimum learning rate.")
    lr_decay_style: str = arg("linear", "Learning-rate decay.",
                              choices=("constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"))
    lr_decay_iters: int | None = arg(None, "Decay iterations (default train_iters).")
    lr_warmup_iters: int = arg(0, "Linear warm-up iterations.")
    lr_warmup_fraction: float | None = arg(None, "Warm-up as a fraction of decay iters.")
    lr_wsd_decay_style: str = arg("exponential", "Decay of the WSD cool-down.",
                                  choices=("exponential", "linear", "cosine"))
    lr_wsd_decay_iters: int | None = arg(None, "Cool-down iterations of WSD.")
    weight_decay: float = arg(0.01, "Weight decay (not applied to norms and biases).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    sgd_momentum: float = arg(0.9, "SGD momentum.")
    clip_grad: float = arg(1.0, "Clip gradients to this global norm (0 disables).")
    loss_scale: float | None = arg(None, "Static loss scale (fp16); dynamic when unset.")
    initial_loss_scale: float = arg(2.0 ** 32, "Initial dynamic loss scale.")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = arg(1000, "Steps without overflow before doubling the scale.")
    hysteresis: int = arg(2, "Overflows tolerated before halving the scale.")

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        _require(0 <= self.min_lr <= max(self.lr, self.min_lr),
                 f"min_lr must be >= 0, got {self.min_lr}")
        _require(self.min_lr <= self.lr,
                 f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        _require(self.lr_warmup_iters >= 0, "lr_warmup_iters must be >= 0")
        if self.lr_warmup_fraction is not None:
            _require(self.lr_warmup_iters == 0,
                     "give either --lr-warmup-fraction or --lr-warmup-iters, not both")
            _require(0 <= self.lr_warmup_fraction <= 1,
                     f"lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        _require(self.weight_decay >= 0, "weight_decay must be >= 0")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
                 "adam betas must be in [0, 1)")
        _require(self.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping)")
        _positive(self, "loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis",
                  "lr_decay_iters", "lr_wsd_decay_iters")


# ----------------------------------------------------------------------------------------
# Data and tokenizer
# ----------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    data_path: list | None = arg(None, "Dataset prefixes, optionally weighted: "
                                    "'0.3 prefixA 0.7 prefixB'.", nargs="*")
    train_data_path: list | None = arg(None, "Training-only prefixes.", nargs="*")
    valid_data_path: list | None = arg(None, "Validation-only prefixes.", nargs="*")
    test_data_path: list | None = arg(None, "Test-only prefixes.", nargs="*")
    split: str = arg("969,30,1", "Train,valid,test split of the documents.")
    data_cache_path: str | None = arg(None, "Where to cache the dataset indices.")
    mock_data: bool = arg(False, "Use synthetic data.")
    tokenizer_type: str | None = arg(None, "Tokenizer.", choices=(
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
        "GPT2BPETokenizer", "NullTokenizer"))
    tokenizer_model: str | None = arg(None, "Tokenizer model file or directory.")
    vocab_file: str | None = arg(None, "Vocabulary file (GPT2BPETokenizer).")
    merge_file: str | None = arg(None, "BPE merges file (GPT2BPETokenizer).")
    num_workers: int = arg(0, "Data-loader worker processes.")
    reset_position_ids: bool = arg(False, "Restart position ids at each document.")
    reset_attention_mask: bool = arg(False, "Do not attend across documents.")
    eod_mask_loss: bool = arg(False, "Do not compute the loss on end-of-document tokens.")

    def __post_init__(self) -> None:
        _check_choices(self)
        _require(self.num_workers >= 0, "num_workers must be >= 0")
        parts = self.split.replace("/", ",").split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, "
                              f"got {self.split!r}") from None
        _require(all(v >= 0 for v in values) and sum(values) > 0 and len(values) <= 3,
                 f"--split must have up to 3 non-negative weights with a positive sum, "
                 f"got {self.split!r}")


# ----------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    micro_batch_size: int = arg(1, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int | None = arg(None, "Samples per optimizer step "
                                           "(default micro_batch_size x dp).")
    train_iters: int | None = arg(None, "Optimizer steps to train for.")
    eval_iters: int = arg(100, "Batches per evaluation.")
    eval_interval: int = arg(1000, "Iterations between evaluations.")
    seed: int = arg(1234, "Random seed.")
    exit_interval: int | None = arg(None, "Exit at an iteration that is a multiple of this.")
    exit_duration_in_mins: float | None = arg(None, "Exit after this many minutes.")
    exit_signal_handler: bool = arg(False, "On SIGTERM, save a checkpoint and exit.")
    check_for_nan_in_loss_and_grad: bool = arg(True, "Stop on a NaN/inf loss or gradient.",
                                               flag="--no-check-for-nan-in-loss-and-grad",
                                               action="store_false")

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "micro_batch_size", "global_batch_size", "train_iters",
                  "eval_interval", "exit_interval", "exit_duration_in_mins")
        _require(self.eval_iters >= 0, "eval_iters must be >= 0")


# ----------------------------------------------------------------------------------------
# Checkpointing
# ----------------------------------------------------------------------------------------
@dataclass
class CheckpointConfig:
    save: str | None = arg(None, "Directory to save checkpoints to.")
    load: str | None = arg(None, "Directory to load a checkpoint from.")
    save_interval: int | None = arg(None, "Iterations between checkpoints.")
    no_save_optim: bool = arg(False, "Do not save the optimizer state.")
    no_save_rng: bool = arg(False, "Do not save the RNG states.")
    no_load_optim: bool = arg(False, "Do not load the optimizer state.")
    no_load_rng: bool = arg(False, "Do not load the RNG states.")
    finetune: bool = arg(False, "Load weights only and start at iteration 0.")
    async_save: bool = arg(False, "Write checkpoints in a background thread.")
    ckpt_verify: bool = arg(False, "Record and check file checksums.")

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "save_interval")


# ----------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------
@dataclass
class LoggingConfig:
    log_interval: int = arg(100, "Iterations between log lines.")
    metrics_jsonl: str | None = arg(None, "Write one JSON object per iteration here.")
    tensorboard_dir: str | None = arg(None, "TensorBoard log directory.")
    wandb_project: str | None = arg(None, "Weights & Biases project.")
    wandb_exp_name: str | None = arg(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = arg(None, "Weights & Biases local directory.")
    timing_log_level: int = arg(0, "0: iteration time only; 1: + forward/backward/"
                                "optimizer; 2: + communication.", choices=(0, 1, 2))
    log_throughput: bool = arg(True, "Report tokens/s and MFU.")

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive(self, "log_interval")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class MegaliteConfig:
    """All sections together; :meth:`validate` checks how they relate."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: int) -> MegaliteConfig:
        """Check the sections against each other for ``world_size`` processes.

        Fills derived values (global batch size default) and returns self.
        """
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor_model_parallel_size
        dp = p.data_parallel_size(world_size)
        if p.sequence_parallel:
            _require(m.seq_length % (tp * p.context_parallel_size) == 0,
                     f"seq_length ({m.seq_length}) must be divisible by "
                     f"tensor_model_parallel_size ({tp}) x context_parallel_size "
                     f"({p.context_parallel_size}) under --sequence-parallel")
        if p.context_parallel_size > 1:
            _require(m.seq_length % (2 * p.context_parallel_size) == 0,
                     f"seq_length ({m.seq_length}) must be divisible by 2 x "
                     f"context_parallel_size ({p.context_parallel_size})")
        self._validate_pipeline()
        self._validate_experts(world_size, dp)
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                 f"global_batch_size ({t.global_batch_size}) must be divisible by "
                 f"micro_batch_size ({t.micro_batch_size}) x data parallel size ({dp})")
        num_micro = t.global_batch_size // (t.micro_batch_size * dp)
        pp = p.pipeline_model_parallel_size
        if p.virtual_pipeline_model_parallel_size and num_micro % pp:
            raise ConfigError(
                f"the interleaved pipeline schedule needs the number of micro-batches "
                f"({num_micro} = global_batch_size {t.global_batch_size} / (micro_batch_size "
                f"{t.micro_batch_size} x data parallel {dp})) to be a multiple of "
                f"pipeline_model_parallel_size ({pp})")
        if self.checkpoint.save_interval is not None and self.checkpoint.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        if not self.data.mock_data and self.data.tokenizer_type == "NullTokenizer":
            _require(m.vocab_size is not None, "NullTokenizer needs --vocab-size")
        return self

    def _validate_pipeline(self) -> None:
        m, p = self.model, self.parallel
        pp = p.pipeline_model_parallel_size
        first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if first is not None or last is not None:
            _require(middle_layers >= 0 and (middle_stages > 0 or middle_layers == 0),
                     f"decoder first/last pipeline layers ({first}, {last}) do not fit "
                     f"num_layers ({m.num_layers}) over {pp} pipeline stages")
            if middle_stages > 0:
                _require(middle_layers % middle_stages == 0,
                         f"the {middle_layers} layers left after the first/last stage "
                         f"must divide over the {middle_stages} middle stages")
        else:
            _require(m.num_layers % pp == 0,
                     f"num_layers ({m.num_layers}) must be divisible by "
                     f"pipeline_model_parallel_size ({pp}) (or set "
                     "--decoder-first/last-pipeline-num-layers)")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = m.num_layers // pp
            _require(per_stage % p.num_layers_per_virtual_pipeline_stage == 0,
                     f"layers per pipeline stage ({per_stage}) must be divisible by "
                     f"num_layers_per_virtual_pipeline_stage "
                     f"({p.num_layers_per_virtual_pipeline_stage})")
            p.virtual_pipeline_model_parallel_size = (
                per_stage // p.num_layers_per_virtual_pipeline_stage)
        vpp = p.virtual_pipeline_model_parallel_size
        if vpp is not None and first is None and last is None:
            _require(m.num_layers % (pp * vpp) == 0,
                     f"num_layers ({m.num_layers}) must be divisible by "
                     f"pipeline_model_parallel_size ({pp}) x virtual pipeline size ({vpp})")

    def _validate_experts(self, world_size: int, dp: int) -> None:
        m, p = self.model, self.parallel
        ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
        if ep > 1 or etp != p.tensor_model_parallel_size:
            _require(m.num_experts is not None,
                     "--expert-model-parallel-size / --expert-tensor-parallel-size need "
                     "--num-experts")
        dense = p.tensor_model_parallel_size * p.context_parallel_size * dp
        _require(dense % (ep * etp) == 0,
                 f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) "
                 f"must divide tp x cp x dp ({dense}) for world size {world_size}")
        m.check_layout(p.tensor_model_parallel_size, p.context_parallel_size, ep, etp)
        _require(not (m.num_experts is not None and m.moe_token_dispatcher_type == "allgather"
                      and p.variable_seq_lengths),
                 "--moe-token-dispatcher-type allgather assumes equal token counts on every "
                 "expert-parallel rank and cannot be used with --variable-seq-lengths; use "
                 "alltoall")

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> MegaliteConfig:
        return cls(**{name: SECTIONS[name](**d.get(name, {})) for name in SECTIONS})
