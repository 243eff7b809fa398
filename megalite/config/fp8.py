"""What ``--fp8-format`` asks of a model's shapes: the recipes, the multiple each fp8 GEMM
dimension must be, and the check that names the first dimension that does not tile."""

from __future__ import annotations

from megalite.config.fields import require

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
# the multiple each fp8 GEMM dimension must be: 16 for per-tensor scales (the kernels'
# rule), the block length for block scales (megalite.layers.fp8.recipes)
FP8_TILE = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}
BLOCK_TILED = ("mxfp8", "blockwise")


def fp8_gemm_dims(m, tp: int, cp: int, micro_batch_size: int, etp: int | None = None
                  ) -> dict[str, int]:
    """Every dimension one rank's fp8 GEMMs contract over (each linear's local input
    and output features, the routed experts' per ``etp`` rank, and the tokens of one
    micro-batch: under context parallelism each of a rank's two sequence chunks; under
    the block recipes also each rank's part of the QKV output that a block must not
    straddle), named for error messages."""
    d, nh, ng = m.kv_channels, m.num_attention_heads, m.num_query_groups
    mult = 2 if m.swiglu else 1
    tokens = (m.seq_length // (2 * cp) if cp > 1 else m.seq_length) * micro_batch_size
    dims = {"hidden_size": m.hidden_size}
    if not all(m.moe_layer_pattern):   # a dense MLP somewhere
        dims.update({"the MLP's fc1 output per tp rank": mult * m.ffn_hidden_size // tp,
                     "ffn_hidden_size / tp": m.ffn_hidden_size // tp})
    if m.num_experts:
        etp = tp if etp is None else etp
        dims.update({
            "the experts' fc1 output per etp rank": mult * m.moe_ffn_hidden_size // etp,
            "moe_ffn_hidden_size / expert_tensor_parallel_size":
                m.moe_ffn_hidden_size // etp})
    if m.multi_latent_attention:   # the tp-split up and output projections
        qk = m.mla_q_head_dim
        dims.update({
            "kv_lora_rank": m.kv_lora_rank,
            "the kv up projection's output per tp rank":
                nh * (m.qk_head_dim + m.v_head_dim) // tp,
            "the query projection's output per tp rank": nh * qk // tp,
            "the attention output per tp rank (heads x v_head_dim / tp)":
                nh * m.v_head_dim // tp})
        if m.q_lora_rank is not None:
            dims["q_lora_rank"] = m.q_lora_rank
    else:
        dims.update({
            "the QKV projection's output per tp rank": (nh + 2 * ng) * d // tp,
            "the attention output per tp rank (heads x kv_channels / tp)": nh * d // tp})
        if m.fp8_recipe in BLOCK_TILED:
            # the input gradient's blocks run along the QKV output, whose whole layout is
            # [q | k | v] and a tp rank's [q_r | k_r | v_r]: blocks line up only where each
            # rank's key (and value) part fills whole blocks
            dims["the QKV projection's key part per tp rank (query groups x kv_channels "
                 "/ tp)"] = ng * d // tp
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        dims["moe_shared_expert_intermediate_size / tp"] = shared // tp
    key = ("tokens per micro-batch and sequence chunk (seq_length / (2 x cp) x "
           "micro_batch_size)" if cp > 1 else "tokens per micro-batch (seq_length x "
           "micro_batch_size)")
    dims[key] = tokens
    return dims


def check_fp8_tiling(m, tp: int, cp: int, micro_batch_size: int,
                     etp: int | None = None) -> None:
    """fp8 GEMMs tile each contraction dimension: multiples of 16 for per-tensor scales
    (the kernels' rule), of the block (32 mxfp8, 128 blockwise) for block scales, so
    that no tp or cp split cuts a block. One ConfigError naming the first dimension that
    does not tile."""
    if m.fp8_format is None:
        return
    multiple = FP8_TILE[m.fp8_recipe]
    for what, n in fp8_gemm_dims(m, tp, cp, micro_batch_size, etp).items():
        require(n % multiple == 0,
                f"--fp8-recipe {m.fp8_recipe} needs every fp8 GEMM dimension to be a "
                f"multiple of {multiple}: {what} is {n} (tp {tp}, cp {cp}, "
                f"micro_batch_size {micro_batch_size}); change the sizes"
                + ("" if m.fp8_recipe in ("tensorwise", "delayed") else
                   " or use --fp8-recipe tensorwise (multiples of 16)"))
