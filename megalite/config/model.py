"""Model shape, precision, recomputation and mixture-of-experts settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from megalite.config.attention import check_attention_variant, check_qk_clip
from megalite.config.fields import ConfigError, arg, check_choices, positive, require
from megalite.config.fp8 import FP8_FORMATS, FP8_RECIPES, check_fp8_tiling
from megalite.config.moe_layers import moe_layer_pattern_of, normalized_freq
from megalite.config.moe_router import check_router
from megalite.config.mtp import check_mtp


def _kernel_names(field: str) -> tuple[str, ...]:
    """The values ``--attention-backend`` / ``--cp-comm-type`` accept: the names of the
    attention kernel registries (``megalite.transformer.attention_kernels``, imported when
    the values are first needed: the one place config reads a package above it, so that a
    new kernel is its file and its registry line), plus ``auto`` and Megatron's names
    (resolved there), and ``a2a+p2p`` (refused below with the reason)."""
    if field == "attention_backend":
        from megalite.transformer.attention_kernels import KERNELS, MEGATRON_ALIASES

        return ("auto", *KERNELS, *MEGATRON_ALIASES)
    from megalite.transformer.attention_kernels.context_parallel import CP_KERNELS

    return (*CP_KERNELS, "a2a+p2p")

RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe")


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
    add_position_embedding: bool = arg(True, "the learned absolute position table of "
                                       "--position-embedding-type learned_absolute (off: "
                                       "no positions at all; with rope there is none "
                                       "either way).",
                                       flag="--no-position-embedding", action="store_false")
    rotary_base: float = arg(10000.0, "RoPE base frequency.")
    rotary_percent: float = arg(1.0, "Fraction of the head dimension that RoPE rotates.")
    normalization: str = arg("LayerNorm", "Normalization layer.",
                             choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "Epsilon of the normalization layers.")
    apply_layernorm_1p: bool = arg(False, "Zero-centred norm weights: the weight w is "
                                   "stored and initialised at 0 and the norm scales by "
                                   "1 + w (LayerNorm and RMSNorm).")
    swiglu: bool = arg(False, "Use SwiGLU in the MLP (Llama).")
    add_bias_linear: bool = arg(True, "biases in the linear layers.",
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
    attention_backend: str = arg("auto", "Attention implementation (Megatron's fused / "
                                 "unfused are sdpa / local here).",
                                 choices=lambda: _kernel_names("attention_backend"))
    cp_comm_type: str = arg("p2p", "How attention exchanges keys/values under "
                            "--context-parallel-size > 1: p2p (ring attention), allgather "
                            "(gather keys/values over cp) or a2a (Ulysses all-to-all from "
                            "sequence to heads); a2a+p2p is not supported.",
                            choices=lambda: _kernel_names("cp_comm_type"))
    # Multi-latent attention (DeepSeek-V2/V3) and QK norm; megalite.transformer.mla
    qk_layernorm: bool = arg(False, "Normalize queries and keys (--normalization, per head "
                             "over the head dim); with --multi-latent-attention the query "
                             "and key/value latents instead (DeepSeek's q_a / kv_a norms).")
    multi_latent_attention: bool = arg(False, "Multi-latent attention (DeepSeek-V2/V3): "
                                       "queries and keys/values through low-rank latents, a "
                                       "decoupled RoPE part shared across heads, YaRN.")
    # Multi-token prediction (DeepSeek-V3); megalite.transformer.mtp
    mtp_num_layers: int | None = arg(None, "Multi-token prediction depths on the last "
                                     "pipeline stage: depth k predicts the token k+1 ahead "
                                     "(0 or unset: none).")
    mtp_loss_scaling_factor: float = arg(0.1, "Weight of the multi-token prediction loss: "
                                         "the depths' mean loss times this is added.")
    q_lora_rank: int | None = arg(None, "Rank of the query latent (none: the queries are one "
                                  "plain projection of the hidden state).")
    kv_lora_rank: int | None = arg(None, "Rank of the key/value latent (default 32, "
                                   "Megatron's, under --multi-latent-attention).")
    qk_head_dim: int | None = arg(None, "Query/key head dim without the RoPE part (default "
                                  "128); a query head has qk_head_dim + qk_pos_emb_head_dim.")
    qk_pos_emb_head_dim: int | None = arg(None, "The decoupled RoPE part of each query/key "
                                          "head, shared by all heads for keys (default 64).")
    v_head_dim: int | None = arg(None, "Value head dim (default 128).")
    rotary_scaling_factor: float = arg(1.0, "YaRN context extension factor of multi-latent "
                                       "attention's RoPE (1: plain RoPE).")
    mscale: float = arg(1.0, "YaRN mscale: the cos/sin of the RoPE part are scaled by "
                        "mscale(factor, mscale) / mscale(factor, mscale_all_dim).")
    mscale_all_dim: float = arg(0.0, "YaRN mscale_all_dim: the softmax scale is multiplied by "
                                "mscale(factor, mscale_all_dim) ** 2.")
    original_max_position_embeddings: int | None = arg(
        None, "The context length the YaRN correction range is computed for (default 4096, "
        "Megatron-Core's MLA default).", aliases=("--yarn-original-max-position-embeddings",))
    # QK-clip (Kimi-K2's MuonClip, Megatron-Core's qk_clip); megalite.transformer.max_logits
    qk_clip: bool = arg(False, "QK-clip: track each head's largest attention logit over the "
                        "global batch and, after every optimizer step, scale the query and "
                        "key weights of a head whose logit passed --qk-clip-threshold by "
                        "(threshold / logit) ** alpha and ** (1 - alpha).")
    qk_clip_threshold: float = arg(100.0, "QK-clip's threshold tau on the largest "
                                   "(softmax-scaled) attention logit of a head.")
    qk_clip_alpha: float = arg(0.5, "QK-clip's balance: the queries take (tau / logit) ** "
                               "alpha, the keys ** (1 - alpha).")
    log_max_attention_logit: bool = arg(False, "Log the largest attention logit of the "
                                        "model (all layers and heads, global batch) every "
                                        "iteration; on with --qk-clip too.")
    masked_softmax_fusion: bool = arg(
        True, "the fused masked-softmax kernel.", flag="--no-masked-softmax-fusion",
        action="store_false",
        no_effect="the attention kernel (--attention-backend) computes its own softmax; "
                  "megalite has no separate masked-softmax kernel to turn off")
    apply_rope_fusion: bool = arg(
        True, "the fused RoPE kernel.", flag="--no-rope-fusion", action="store_false",
        no_effect="megalite's RoPE is one autograd function eagerly and one inductor kernel "
                  "under torch.compile, the plain formula's values either way; there is no "
                  "separate kernel to turn off")
    bias_swiglu_fusion: bool = arg(
        True, "the fused bias + SwiGLU kernel.", flag="--no-bias-swiglu-fusion",
        action="store_false",
        no_effect="megalite's SwiGLU is one autograd function eagerly and one inductor kernel "
                  "under torch.compile, the plain formula's values either way; there is no "
                  "separate kernel to turn off")
    bias_gelu_fusion: bool = arg(
        True, "the fused bias + GeLU kernel.", flag="--no-bias-gelu-fusion",
        action="store_false",
        no_effect="megalite's GeLU is the plain formula eagerly and one inductor kernel "
                  "under torch.compile; there is no separate kernel to turn off")
    bias_dropout_fusion: bool = arg(
        True, "the fused bias + dropout + add kernel.", flag="--no-bias-dropout-fusion",
        action="store_false",
        no_effect="megalite adds the bias, dropout and residual with plain ops (fused by "
                  "inductor under torch.compile); there is no separate kernel to turn off")
    persist_layer_norm: bool = arg(
        True, "apex's persistent LayerNorm kernel.", flag="--no-persist-layer-norm",
        action="store_false",
        no_effect="megalite's norms are torch's (or its own RMSNorm); there is no apex "
                  "kernel to turn off")
    gradient_accumulation_fusion: bool = arg(
        True, "the fused kernel that adds a weight gradient into its fp32 main_grad.",
        flag="--no-gradient-accumulation-fusion", action="store_false",
        no_effect="megalite adds each weight gradient into its main_grad buffer with "
                  "plain PyTorch ops; there is no apex / Transformer Engine kernel to "
                  "turn off")
    use_cpu_initialization: bool = arg(
        False, "Initialize the weights on the CPU.",
        no_effect="megalite always draws each parameter's full tensor on the CPU from "
                  "(seed, name) and keeps this rank's shard, so the weights do not depend "
                  "on the layout; that is what the flag asks for")
    transformer_impl: str | None = arg(
        None, "Megatron's choice of layer implementation (Transformer Engine's or "
        "Megatron-Core's local one).", choices=("transformer_engine", "local"),
        no_effect="megalite has one implementation of the transformer layers "
                  "(megalite.transformer), which both values run; the checkpoint records "
                  "it, and convert_checkpoint.py --target megatron names the layer norms "
                  "as that Megatron layer spec does")
    use_flash_attn: bool = arg(
        False, "Megatron's older switch for flash attention.",
        no_effect="--attention-backend auto (the default) already runs flash-attn where it "
                  "is installed and usable (CUDA, fp16/bf16), else sdpa; give "
                  "--attention-backend flash to require it")
    use_mcore_models: bool = arg(
        False, "Use the Megatron-Core model implementation.",
        no_effect="megalite has one model implementation, laid out as Megatron-Core's; "
                  "there is no legacy model to choose between")
    cross_entropy_loss_fusion: bool = arg(False, "Fused vocab-parallel cross entropy: the "
                                          "loss is computed in chunks of the sequence so the "
                                          "fp32 copy of the logits is never whole in memory.")
    cross_entropy_fusion_impl: str = arg("native", "Implementation of the fused cross "
                                         "entropy (te needs Transformer Engine).",
                                         choices=("native", "te"))
    recompute_granularity: str | None = arg(None, "Activation recomputation.",
                                               choices=("full", "selective"))
    recompute_method: str | None = arg(None, "Which layers full recomputation covers.",
                                          choices=("uniform", "block"))
    recompute_num_layers: int | None = arg(None, "Layers per recompute unit (uniform) or "
                                              "recomputed layers per stage (block).")
    recompute_modules: list[str] | None = arg(
        None, "What --recompute-granularity selective recomputes: core_attn (the attention "
        "kernel; the default), layernorm (the input and pre-MLP norms), mla_up_proj "
        "(multi-latent attention's up projections and RoPE), mlp (the dense MLPs), moe "
        "(the MoE layers' dispatch, experts and shared experts; not the router).",
        nargs="*", choices=RECOMPUTE_MODULES)
    moe_layer_recompute: bool = arg(False, "Megatron's older spelling of "
                                    "--recompute-granularity selective with moe added to "
                                    "--recompute-modules (core_attn by default): the MoE "
                                    "layers are recomputed in backward.")
    cpu_offloading: bool = arg(False, "Offload the saved activations of the first "
                               "--cpu-offloading-num-layers layers of each model chunk to "
                               "host memory during forward, brought back in backward.")
    cpu_offloading_num_layers: int = arg(0, "Transformer layers per model chunk whose saved "
                                         "activations --cpu-offloading offloads (< num_layers).")
    cpu_offloading_activations: bool = arg(True, "What --cpu-offloading offloads: the saved "
                                           "activations (--no-cpu-offloading-activations: not).",
                                           action=argparse.BooleanOptionalAction)
    cpu_offloading_weights: bool = arg(False, "Offload weights too (not supported: megalite "
                                       "keeps parameters on the device).")
    bf16: bool = arg(False, "Train in bfloat16 with fp32 master weights.")
    fp16: bool = arg(False, "Train in float16 with dynamic loss scaling.")
    # fp8 GEMMs in the transformer layers' linears (megalite.layers.fp8)
    fp8_format: str | None = arg(None, "fp8 GEMMs: e4m3 everywhere, or hybrid (e4m3 "
                                 "forward, e5m2 gradients).", choices=FP8_FORMATS)
    fp8_recipe: str = arg("delayed", "fp8 scaling recipe: delayed (scales from an amax "
                          "history), tensorwise (from each tensor's amax), mxfp8 (32-element "
                          "blocks, e8m0 scales) or blockwise (128-element blocks, fp32 "
                          "scales).", choices=FP8_RECIPES)
    fp8_margin: int = arg(0, "Scale fp8 tensors down by 2^margin below the largest value "
                          "the format holds.")
    fp8_amax_history_len: int = arg(1, "Length of the amax history window (delayed "
                                    "scaling).")
    fp8_amax_compute_algo: str = arg("most_recent", "How the scale is computed from the "
                                     "amax history.", choices=("most_recent", "max"))
    fp8_wgrad: bool = arg(True, "the weight-gradient GEMM in fp8 (--no-fp8-wgrad: in the "
                          "training precision).", flag="--no-fp8-wgrad",
                          action="store_false")
    fp8_param_gather: bool = arg(
        False, "All-gather the weights of fp8 linears in fp8 (one byte per element), "
        "quantised once per step on the ranks owning their shards, and use them in the "
        "forward's fp8 GEMMs (needs --fp8-format with the tensorwise or delayed recipe and "
        "the distributed optimizer).")
    first_last_layers_bf16: bool = arg(False, "Under --fp8-format, keep the first "
                                       "--num-layers-at-start-in-bf16 and the last "
                                       "--num-layers-at-end-in-bf16 transformer layers out "
                                       "of fp8.")
    num_layers_at_start_in_bf16: int = arg(1, "Transformer layers at the start kept out of "
                                           "fp8 by --first-last-layers-bf16.")
    num_layers_at_end_in_bf16: int = arg(1, "Transformer layers at the end kept out of fp8 "
                                         "by --first-last-layers-bf16.")
    # Mixture of experts
    num_experts: int | None = arg(None, "Number of experts (MoE when set).")
    moe_router_topk: int = arg(2, "Experts per token.")
    moe_ffn_hidden_size: int | None = arg(None, "Expert MLP hidden size (default ffn).")
    moe_layer_freq: str | int = arg(1, "Which layers are MoE layers: every n-th one from "
                                    "layer 0 (an integer), or Megatron's Python list "
                                    "expression of one 0/1 per layer (\"[0]*3+[1]*58\": "
                                    "three dense layers, then MoE).")
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
    moe_token_dispatcher_type: str = arg(
        "alltoall", "Token dispatcher (flex: Megatron's DeepEP / HybridEP dispatcher, run "
        "here as alltoall).", choices=("alltoall", "allgather", "flex"),
        no_effect_values={"flex": "DeepEP / HybridEP are not used by megalite; the flex "
                                  "dispatcher runs as the alltoall dispatcher (the same "
                                  "tokens and results, only the kernels differ)"})
    moe_grouped_gemm: bool = arg(
        False, "Run the local experts as one grouped GEMM.",
        no_effect="megalite's experts always run as one grouped GEMM (a padded batched "
                  "matmul over the local experts); there is no per-expert loop to replace")
    # Routing of DeepSeek-V3 / Kimi-K2 / Qwen3-MoE (megalite.moe.router)
    moe_router_pre_softmax: bool = arg(False, "Softmax over all experts before the top-k "
                                       "(softmax score function); the chosen probabilities "
                                       "are then not renormalized. With sigmoid scores it "
                                       "changes nothing, as in Megatron.")
    moe_router_num_groups: int | None = arg(None, "Groups the experts are split into for "
                                            "group-limited routing (DeepSeek-V3: one per "
                                            "node, so that a token reaches few nodes).")
    moe_router_group_topk: int | None = arg(None, "Groups a token may be routed to "
                                            "(group-limited routing; needs "
                                            "--moe-router-num-groups).")
    moe_router_dtype: str | None = arg(None, "dtype of the router's logits, scores and "
                                       "probabilities: fp32 (also what megalite uses when "
                                       "unset) or fp64.", choices=("fp32", "fp64"))
    moe_router_enable_expert_bias: bool = arg(False, "Aux-loss-free load balancing: a "
                                              "per-expert bias added to the sigmoid scores "
                                              "for the choice of experts only, moved once "
                                              "per optimizer step towards the mean load of "
                                              "the whole global batch.")
    moe_router_bias_update_rate: float = arg(1e-3, "Step of the expert bias update: bias += "
                                             "rate * sign(mean load - expert load).")
    moe_router_force_load_balancing: bool = arg(False, "Benchmark mode: route on random "
                                                "logits (straight-through to the real "
                                                "ones), so the experts get even loads; the "
                                                "curve is not the model's and depends on "
                                                "the layout.")
    moe_flex_dispatcher_backend: str = arg(
        "deepep", "Kernels of --moe-token-dispatcher-type flex.",
        choices=("deepep", "hybridep"),
        no_effect="DeepEP / HybridEP are not used by megalite; flex runs as alltoall")
    moe_permute_fusion: bool = arg(
        False, "Fused token permutation kernels.",
        no_effect="megalite permutes tokens with a few index operations on the routing "
                  "map (no loop over experts); there is no fused kernel to choose")
    moe_router_fusion: bool = arg(
        False, "Fused router top-k / score kernels.",
        no_effect="the router runs as a few fp32 tensor operations; there is no fused "
                  "kernel to choose")
    moe_shared_expert_overlap: bool = arg(
        False, "Run the shared experts' forward while the alltoall dispatcher's token "
        "all-to-all over expert-parallel ranks is in flight (bitwise the same results); "
        "without it they run after the routed experts. Only effective with "
        "--moe-shared-expert-intermediate-size and expert parallel size > 1.")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                  "ffn_hidden_size", "kv_channels", "num_query_groups",
                  "make_vocab_size_divisible_by", "vocab_size", "init_method_std",
                  "norm_epsilon", "rotary_base", "num_experts", "moe_router_topk",
                  "fp8_amax_history_len")
        self.moe_layer_freq = normalized_freq(self.moe_layer_freq)
        if isinstance(self.moe_layer_freq, int):
            positive(self, "moe_layer_freq")
        else:
            moe_layer_pattern_of(self.moe_layer_freq, self.num_layers)  # checks it
        require(self.cp_comm_type != "a2a+p2p",
                 "--cp-comm-type a2a+p2p (hierarchical context parallelism) is not "
                 "supported; use p2p, allgather or a2a")
        require(self.cross_entropy_fusion_impl == "native",
                 "--cross-entropy-fusion-impl te needs Transformer Engine, which megalite "
                 "does not use; use native (the default)")
        self._check_fp8()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            require(self.hidden_size % self.num_attention_heads == 0,
                     f"hidden_size ({self.hidden_size}) must be divisible by "
                     f"num_attention_heads ({self.num_attention_heads}), or set --kv-channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention:
            require(self.num_query_groups in (None, self.num_attention_heads),
                     f"--num-query-groups ({self.num_query_groups}) needs "
                     "--group-query-attention")
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups")
        require(self.num_attention_heads % self.num_query_groups == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                 f"num_query_groups ({self.num_query_groups})")
        check_attention_variant(self)
        check_qk_clip(self)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.learned_positions:
            require(self.max_position_embeddings >= self.seq_length,
                     f"max_position_embeddings ({self.max_position_embeddings}) must be >= "
                     f"seq_length ({self.seq_length}) with learned absolute positions")
        require(0.0 < self.rotary_percent <= 1.0,
                 f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"{name} must be in [0, 1), got {value}")
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 cannot both be set")
        if self.recompute_method is not None:
            require(self.recompute_granularity == "full",
                     "--recompute-method needs --recompute-granularity full")
        if self.moe_layer_recompute:
            require(self.recompute_granularity != "full",
                    "--moe-layer-recompute recomputes the MoE layers selectively; it cannot "
                    "be combined with --recompute-granularity full")
            self.recompute_granularity = "selective"
            modules = self.recompute_modules or ["core_attn"]
            self.recompute_modules = modules if "moe" in modules else [*modules, "moe"]
        self._check_recompute_modules()
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                self.recompute_method = "uniform"
            if self.recompute_num_layers is None:
                self.recompute_num_layers = 1
        self._check_cpu_offloading()
        check_mtp(self)
        if self.num_experts is not None:
            require(self.moe_router_topk <= self.num_experts,
                     f"moe_router_topk ({self.moe_router_topk}) must be <= num_experts "
                     f"({self.num_experts})")
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
        positive(self, "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
        if self.moe_router_topk_scaling_factor is not None:
            require(self.moe_router_topk_scaling_factor > 0,
                     f"moe_router_topk_scaling_factor must be positive, got "
                     f"{self.moe_router_topk_scaling_factor}")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            value = getattr(self, name)
            require(value is None or value >= 0, f"{name} must be >= 0, got {value}")
        if self.moe_expert_capacity_factor is not None:
            require(self.moe_expert_capacity_factor > 0,
                     "moe_expert_capacity_factor must be positive")
        if self.moe_pad_expert_input_to_capacity:
            require(self.moe_expert_capacity_factor is not None,
                     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.moe_shared_expert_overlap and self.moe_shared_expert_intermediate_size:
            require(self.moe_token_dispatcher_type in ("alltoall", "flex"),
                    "--moe-shared-expert-overlap hides the shared experts behind the alltoall "
                    "dispatcher's all-to-all, not --moe-token-dispatcher-type "
                    f"{self.moe_token_dispatcher_type}; use alltoall or drop the flag")
        check_router(self)

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Which of the ``num_layers`` layers (0-based, global) have an MoE MLP
        (``--moe-layer-freq``); all False without ``--num-experts``."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        return moe_layer_pattern_of(self.moe_layer_freq, self.num_layers)

    @property
    def mla_q_head_dim(self) -> int:
        """A multi-latent attention query/key head: ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def _check_recompute_modules(self) -> None:
        """``--recompute-modules``: Megatron's default ``core_attn``; the kinds megalite
        implements."""
        if self.recompute_modules is None:
            if self.recompute_granularity == "selective":
                self.recompute_modules = ["core_attn"]
            return
        require(self.recompute_granularity == "selective",
                "--recompute-modules needs --recompute-granularity selective")
        require("mla_up_proj" not in self.recompute_modules or self.multi_latent_attention,
                "--recompute-modules mla_up_proj needs --multi-latent-attention")

    def recomputes(self, module: str) -> bool:
        """Selective recomputation covers ``module`` (a ``--recompute-modules`` kind)."""
        return (self.recompute_granularity == "selective"
                and module in (self.recompute_modules or ()))

    def _check_fp8(self) -> None:
        require(not self.fp8_param_gather or self.fp8_format is not None,
                 "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
        if self.fp8_format is None:
            return
        require(not self.fp8_param_gather or self.fp8_recipe in ("tensorwise", "delayed"),
                f"--fp8-param-gather with --fp8-recipe {self.fp8_recipe} is not supported: "
                "a block recipe quantises each weight in two layouts (blocks along its input "
                "features for the forward, along its output features for the input "
                "gradient), so gathering fp8 would send both, about 2.06 bytes per element "
                "against bf16's 2; use --fp8-recipe tensorwise or delayed, or drop "
                "--fp8-param-gather")
        require(not self.fp16,
                f"--fp8-format {self.fp8_format} with --fp16 is not supported: fp8 GEMMs "
                "take bf16 or fp32 activations and weights; use --bf16 (or neither)")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            require(getattr(self, name) >= 0, f"--{name.replace('_', '-')} must be >= 0, "
                    f"got {getattr(self, name)}")
        require(self.fp8_margin >= 0, f"--fp8-margin must be >= 0, got {self.fp8_margin}")

    def check_fp8_tiling(self, tp: int, cp: int, micro_batch_size: int,
                         etp: int | None = None) -> None:
        """One ConfigError naming the first fp8 GEMM dimension the recipe cannot tile
        (:func:`megalite.config.fp8.check_fp8_tiling`)."""
        check_fp8_tiling(self, tp, cp, micro_batch_size, etp)

    def _check_cpu_offloading(self) -> None:
        """Megatron's rule (0 <= layers < num_layers) and what megalite offloads."""
        n = self.cpu_offloading_num_layers
        require(not self.cpu_offloading_weights,
                "--cpu-offloading-weights is not supported: megalite keeps parameters on the "
                "device and never copies the weights saved for backward; shard them with "
                "--data-parallel-sharding-strategy or offload the optimizer state with "
                "--optimizer-cpu-offload")
        if not self.cpu_offloading:
            require(n == 0, f"--cpu-offloading-num-layers ({n}) needs --cpu-offloading")
            return
        require(0 <= n < self.num_layers,
                f"--cpu-offloading-num-layers ({n}) must be >= 0 and < num_layers "
                f"({self.num_layers})")
        require(self.cpu_offloading_activations,
                "--cpu-offloading with --no-cpu-offloading-activations offloads nothing; "
                "drop --cpu-offloading")

    @property
    def learned_positions(self) -> bool:
        """The model has a learned absolute position table (``learned_absolute`` without
        ``--no-position-embedding``)."""
        return self.position_embedding_type == "learned_absolute" and self.add_position_embedding

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' and activations' dtype: bfloat16 (``--bf16``), float16
        (``--fp16``) or float32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def check_layout(self, tp: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        """What the model needs from a layout's sizes; the one place these rules live
        (``MegaliteConfig.validate`` and the model builders call it)."""
        etp = tp if etp is None else etp
        for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            require(getattr(self, name) % tp == 0,
                     f"{name} ({getattr(self, name)}) must be divisible by "
                     f"tensor_model_parallel_size ({tp})")
        if cp > 1 and self.cp_comm_type == "a2a":  # Ulysses splits the heads over cp
            for name in ("num_attention_heads", "num_query_groups"):
                require(getattr(self, name) % (tp * cp) == 0,
                         f"--cp-comm-type a2a needs {name} ({getattr(self, name)}) divisible "
                         f"by tensor_model_parallel_size ({tp}) x context_parallel_size "
                         f"({cp}); use --cp-comm-type p2p or allgather")
        if self.num_experts is None:
            return
        require(self.num_experts % ep == 0,
                 f"num_experts ({self.num_experts}) must be divisible by "
                 f"expert_model_parallel_size ({ep})")
        if tp > 1:  # the MoE layer splits the sequence over tp, with or without SP
            require(self.seq_length % (tp * cp) == 0,
                     f"seq_length ({self.seq_length}) must be divisible by "
                     f"tensor_model_parallel_size ({tp}) x context_parallel_size ({cp}) "
                     f"with --num-experts (MoE layers split the sequence over tp)")
        require(self.moe_ffn_hidden_size % etp == 0,
                 f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be divisible by "
                 f"expert_tensor_parallel_size ({etp})")
        if self.add_bias_linear:
            require(etp in (1, tp),
                     f"expert biases need expert_tensor_parallel_size ({etp}) equal to 1 or "
                     f"to tensor_model_parallel_size ({tp}); or pass --disable-bias-linear")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None:
            require(shared % tp == 0,
                     f"moe_shared_expert_intermediate_size ({shared}) must be divisible by "
                     f"tensor_model_parallel_size ({tp})")

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * tp."""
        require(self.vocab_size is not None, "vocab_size is unknown: pass --vocab-size or "
                 "a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple
