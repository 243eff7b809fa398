"""What the model config implies for one rank's tensors: parameter counts, the GEMM shapes
of the linear layers, and the model FLOPs per token that MFU counts.

Everything here is arithmetic on a :class:`~megalite.config.model.ModelConfig` (``m``) and
the tensor / expert split; the built model must agree (the dry run checks the counts
against the parameters it builds on the meta device).

Model FLOPs per token (:func:`flops_per_token`) follow the PaLM / Megatron-LM count:
``6 N + 6 h V + 6 L s n (d_qk + d_v)`` -- ``6 N`` for the matmuls of the ``N``
transformer-layer parameters a token passes through (forward 2N, backward 4N; an MoE layer
counts its router and ``top-k`` experts, not all of them), ``6 h V`` for the output layer
(hidden ``h``, padded vocabulary ``V``) and ``6 L s n (d_qk + d_v)`` for the attention
scores and values (``L`` layers, sequence ``s``, ``n`` heads of query/key width ``d_qk``
and value width ``d_v``: ``12 L h s`` when ``n d = h``; multi-latent attention's
``d_qk = qk_head_dim + qk_pos_emb_head_dim``, ``d_v = v_head_dim``, and its ``N`` holds
its down and up projections). Embedding tables are a lookup and count nothing.

Each multi-token prediction depth (``--mtp-num-layers``) is one more layer of the last
layer's kind with its own attention scores, an output layer, and in ``N`` its three norms
and the ``2h -> h`` projection (:func:`mtp_depth_params`).
"""

from __future__ import annotations


def norm_params(m) -> int:
    """Elements of one norm over ``h`` (RMSNorm: a weight; LayerNorm: weight and bias)."""
    return m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)


def is_moe_layer(m, layer: int) -> bool:
    """Whether global layer ``layer`` has an MoE MLP (``--moe-layer-freq``: every n-th
    from 0, or the list's 0/1 per layer; ``ModelConfig.moe_layer_pattern``)."""
    return m.moe_layer_pattern[layer]


def fp8_layer(m, layer: int) -> bool:
    """Whether global layer ``layer`` runs its linears in fp8: ``--fp8-format`` is set and
    ``--first-last-layers-bf16`` does not keep it in higher precision (the first
    ``--num-layers-at-start-in-bf16`` and last ``--num-layers-at-end-in-bf16``)."""
    if m.fp8_format is None:
        return False
    if not m.first_last_layers_bf16:
        return True
    return m.num_layers_at_start_in_bf16 <= layer < m.num_layers - m.num_layers_at_end_in_bf16


def moe_layer_count(m) -> int:
    """MoE layers of the model."""
    return sum(is_moe_layer(m, layer) for layer in range(m.num_layers))


def _norm(m, size: int) -> int:
    return size * (1 if m.normalization == "RMSNorm" else 2)


def attention_head_dims(m) -> tuple[int, int]:
    """(query/key, value) head widths: ``kv_channels`` twice, or multi-latent attention's
    ``qk_head_dim + qk_pos_emb_head_dim`` and ``v_head_dim``."""
    if m.multi_latent_attention:
        return m.mla_q_head_dim, m.v_head_dim
    return m.kv_channels, m.kv_channels


def mla_params(m, tp: int) -> int:
    """Multi-latent attention's projections and latent norms on one tp rank: the down
    projections and norms whole (replicated), the up projections ``1/tp``."""
    h, n = m.hidden_size, m.num_attention_heads
    q_out = n * m.mla_q_head_dim
    if m.q_lora_rank is None:
        total = h * q_out // tp
    else:
        total = h * m.q_lora_rank + m.q_lora_rank * q_out // tp
        total += _norm(m, m.q_lora_rank) if m.qk_layernorm else 0
    total += h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
    total += m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim) // tp
    total += _norm(m, m.kv_lora_rank) if m.qk_layernorm else 0
    return total


def mla_up_proj_params(m) -> int:
    """The up projections (query and key/value) of one multi-latent attention layer, whole
    model (what ``--recompute-modules mla_up_proj`` runs again)."""
    n = m.num_attention_heads
    q_in = m.hidden_size if m.q_lora_rank is None else m.q_lora_rank
    return n * (q_in * m.mla_q_head_dim + m.kv_lora_rank * (m.qk_head_dim + m.v_head_dim))


def dense_layer_params(m, tp: int) -> int:
    """Parameter elements of one transformer layer's attention and norms on one tp rank
    (the MLP is counted apart: :func:`dense_mlp_params`, :func:`moe_mlp_params`)."""
    h, nh, ng, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    if m.multi_latent_attention:
        n = mla_params(m, tp) + nh * m.v_head_dim * h // tp
    else:
        qkv_out = (nh + 2 * ng) * d
        n = h * qkv_out // tp + (qkv_out // tp if (m.add_bias_linear or m.add_qkv_bias)
                                 else 0)
        n += nh * d * h // tp + (2 * _norm(m, d) if m.qk_layernorm else 0)
    n += (h if m.add_bias_linear else 0) + 2 * norm_params(m)
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


def mtp_depths(m) -> int:
    """Multi-token prediction depths (``--mtp-num-layers``; 0 without)."""
    return m.mtp_num_layers or 0


def mtp_depth_params(m, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, int]:
    """(dense, expert) elements of one multi-token prediction depth on one rank: its
    three norms (enorm, hnorm, final), ``eh_proj`` ``[h/tp, 2h]`` and a transformer layer
    of the kind of the last decoder layer (``megalite.transformer.mtp``)."""
    dense, expert = layer_params(m, m.num_layers - 1, tp, ep, etp)
    return dense + 3 * norm_params(m) + 2 * m.hidden_size * m.hidden_size // tp, expert


def _active(m, dense: int, experts: int) -> int:
    return dense + experts // m.num_experts * m.moe_router_topk if experts else dense


def active_layer_params(m) -> int:
    """Transformer-layer parameters a token passes through (whole model, tp 1): attention,
    norms and dense MLPs, the router and ``top-k`` experts of MoE layers, the final norm;
    and every multi-token prediction depth's (:func:`mtp_depth_params`)."""
    n = sum(_active(m, *layer_params(m, layer)) for layer in range(m.num_layers))
    return n + norm_params(m) + mtp_depths(m) * _active(m, *mtp_depth_params(m))


def flops_per_token(m, padded_vocab_size: int) -> float:
    """Training FLOPs (forward + backward) per token of the whole model:
    ``6 N + 6 h V + 6 L s n (d_qk + d_v)`` (module docstring), where the ``D`` multi-token
    prediction depths add their parameters to ``N``, ``D`` output layers to ``h V`` and
    ``D`` layers to ``L``."""
    d_qk, d_v = attention_head_dims(m)
    heads = 1 + mtp_depths(m)
    layers = m.num_layers + mtp_depths(m)
    return (6.0 * active_layer_params(m) + 6.0 * heads * m.hidden_size * padded_vocab_size
            + 6.0 * layers * m.seq_length * m.num_attention_heads * (d_qk + d_v))


def attention_gemms(m, tokens: int, tp: int = 1, down: bool = True
                    ) -> list[tuple[int, int, int]]:
    """``(tokens, in, out)`` of one layer's attention projections on one tp rank: qkv and
    the output projection; under multi-latent attention the query (down and up, or one)
    and key/value (down, up) projections, then the output projection (``down`` False: the
    down projections left out, as ``--fp8-format`` keeps them in the training dtype). The
    down projections see this rank's tokens under sequence parallelism, counted here as
    the whole ``tokens``."""
    h, n = m.hidden_size, m.num_attention_heads
    if not m.multi_latent_attention:
        d = m.kv_channels
        return [(tokens, h, (n + 2 * m.num_query_groups) * d // tp),
                (tokens, n * d // tp, h)]
    lora = m.q_lora_rank is not None
    q_down = [(tokens, h, m.q_lora_rank)] if lora and down else []
    q_up = (tokens, m.q_lora_rank if lora else h, n * m.mla_q_head_dim // tp)
    kv_down = [(tokens, h, m.kv_lora_rank + m.qk_pos_emb_head_dim)] if down else []
    return [*q_down, q_up, *kv_down,
            (tokens, m.kv_lora_rank, n * (m.qk_head_dim + m.v_head_dim) // tp),
            (tokens, n * m.v_head_dim // tp, h)]


def layer_gemms(m, tokens: int, tp: int = 1, ffn: int | None = None, down: bool = True
                ) -> list[tuple[int, int, int]]:
    """``(tokens, in, out)`` of one dense transformer layer's linear layers on one tp rank
    for ``tokens`` tokens: the attention's (:func:`attention_gemms`, ``down`` as there),
    then fc1, fc2 of an MLP of width ``ffn`` (default ``--ffn-hidden-size``; 0: none)
    (``x [tokens, in] @ w [in, out]``; each also runs ``g @ w.T`` and ``x.T @ g`` in
    backward)."""
    h = m.hidden_size
    ffn = m.ffn_hidden_size if ffn is None else ffn
    mlp = [(tokens, h, (2 if m.swiglu else 1) * ffn // tp), (tokens, ffn // tp, h)]
    return [*attention_gemms(m, tokens, tp, down), *(mlp if ffn else [])]


def model_params(m, padded_vocab_size: int) -> tuple[int, int]:
    """(total, active per token) parameter elements of the whole model at tp 1: the word
    embedding, learned absolute positions where used, every transformer layer (all experts;
    the router and ``top-k`` experts for the active count), the final norm and, untied, the
    output layer -- the figures model cards state (DeepSeek-V3: 671B total, 37B active)."""
    h = m.hidden_size
    outer = padded_vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1)
    if m.learned_positions:
        outer += m.max_position_embeddings * h
    total = sum(sum(layer_params(m, layer)) for layer in range(m.num_layers))
    return total + norm_params(m) + outer, active_layer_params(m) + outer
