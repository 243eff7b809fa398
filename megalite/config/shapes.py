"""What the model config implies for one rank's tensors: parameter counts, the GEMM shapes
of the linear layers, and the model FLOPs per token that MFU counts.

Everything here is arithmetic on a :class:`~megalite.config.model.ModelConfig` (``m``) and
the tensor / expert split; the built model must agree (the dry run checks the counts
against the parameters it builds on the meta device).

Model FLOPs per token (:func:`flops_per_token`) follow the PaLM / Megatron-LM count:
``6 N + 6 h V + 12 L h s`` -- ``6 N`` for the matmuls of the ``N`` transformer-layer
parameters a token passes through (forward 2N, backward 4N; an MoE layer counts its router
and ``top-k`` experts, not all of them), ``6 h V`` for the output layer (hidden ``h``,
padded vocabulary ``V``) and ``12 L h s`` for the attention scores and values (``L``
layers, sequence ``s``). Embedding tables are a lookup and count nothing.
"""

from __future__ import annotations


def norm_params(m) -> int:
    """Elements of one norm over ``h`` (RMSNorm: a weight; LayerNorm: weight and bias)."""
    return m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)


def is_moe_layer(m, layer: int) -> bool:
    """Whether global layer ``layer`` has an MoE MLP (``--moe-layer-freq``: every n-th
    from 0, or the list's 0/1 per layer; ``ModelConfig.moe_layer_pattern``)."""
    return m.moe_layer_pattern[layer]


def moe_layer_count(m) -> int:
    """MoE layers of the model."""
    return sum(is_moe_layer(m, layer) for layer in range(m.num_layers))


def dense_layer_params(m, tp: int) -> int:
    """Parameter elements of one transformer layer's attention and norms on one tp rank
    (the MLP is counted apart: :func:`dense_mlp_params`, :func:`moe_mlp_params`)."""
    h, nh, ng, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    qkv_out = (nh + 2 * ng) * d
    n = h * qkv_out // tp + (qkv_out // tp if (m.add_bias_linear or m.add_qkv_bias) else 0)
    n += nh * d * h // tp + (h if m.add_bias_linear else 0)
    n += 2 * norm_params(m)
    return n


def dense_mlp_params(m, tp: int, ffn: int | None = None) -> int:
    """Parameter elements of a dense MLP of width ``ffn`` (default ``ffn_hidden_size``) on
    one tp rank."""
    h, f = m.hidden_size, ffn or m.ffn_hidden_size
    fc1 = (2 if m.swiglu else 1) * f
    n = h * fc1 // tp + f * h // tp
    if m.add_bias_linear:
        n += fc1 // tp + h
    return n


def moe_mlp_params(m, tp: int, ep: int, etp: int) -> tuple[int, int]:
    """(dense, expert) elements of one MoE layer's MLP on one rank: router (and shared
    expert) are dense; the ``num_experts / ep`` local experts are split over ``etp``."""
    h, f = m.hidden_size, m.moe_ffn_hidden_size
    fc1 = (2 if m.swiglu else 1) * f
    per_expert = h * fc1 // etp + f * h // etp
    if m.add_bias_linear:
        per_expert += fc1 // etp + h
    dense = m.num_experts * h
    if m.moe_shared_expert_intermediate_size:
        dense += dense_mlp_params(m, tp, m.moe_shared_expert_intermediate_size)
    return dense, per_expert * (m.num_experts // ep)


def layer_params(m, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) elements of global layer ``layer`` on one rank."""
    if is_moe_layer(m, layer):
        dense, expert = moe_mlp_params(m, tp, ep, etp)
        return dense_layer_params(m, tp) + dense, expert
    return dense_layer_params(m, tp) + dense_mlp_params(m, tp), 0


def active_layer_params(m) -> int:
    """Transformer-layer parameters a token passes through (whole model, tp 1): attention,
    norms and dense MLPs, the router and ``top-k`` experts of MoE layers, the final norm."""
    n = 0
    for layer in range(m.num_layers):
        dense, experts = layer_params(m, layer)
        n += dense + experts // m.num_experts * m.moe_router_topk if experts else dense
    return n + norm_params(m)


def flops_per_token(m, padded_vocab_size: int) -> float:
    """Training FLOPs (forward + backward) per token of the whole model:
    ``6 N + 6 h V + 12 L h s`` (module docstring)."""
    return (6.0 * active_layer_params(m) + 6.0 * m.hidden_size * padded_vocab_size
            + 12.0 * m.num_layers * m.hidden_size * m.seq_length)


def layer_gemms(m, tokens: int, tp: int = 1) -> list[tuple[int, int, int]]:
    """``(tokens, in, out)`` of one dense transformer layer's linear layers on one tp rank
    for ``tokens`` tokens: qkv, attention projection, fc1, fc2 (``x [tokens, in] @
    w [in, out]``; each also runs ``g @ w.T`` and ``x.T @ g`` in backward)."""
    h, d = m.hidden_size, m.kv_channels
    fc1 = (2 if m.swiglu else 1) * m.ffn_hidden_size
    return [(tokens, h, (m.num_attention_heads + 2 * m.num_query_groups) * d // tp),
            (tokens, m.num_attention_heads * d // tp, h),
            (tokens, h, fc1 // tp), (tokens, m.ffn_hidden_size // tp, h)]
