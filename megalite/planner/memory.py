"""Memory per rank of a layout: an estimate, term by term, in bytes.

For one rank (pipeline stage ``pp_rank``) of a validated :class:`MegaliteConfig`:

* **params / grads / optimizer** -- this rank's parameter elements ``P`` (its tp / ep / pp
  slice, counted from the model's shapes: :func:`stage_param_counts`) times the bytes per
  parameter of ZeRO's accounting (:func:`megalite.optim.memory.expected_bytes_per_param`):
  parameters in the training dtype, gradients in fp32 (bf16 with
  ``--grad-reduce-in-bf16``), Adam's two fp32 moments plus an fp32 master copy when
  training in half precision, the optimizer (and with optim_grads the gradients) divided
  by the data-parallel group that shards them: dp x cp for dense parameters, the expert
  data-parallel size for experts. Under optim_grads (and optim_grads_params) no rank holds
  the whole gradient: each bucket is reduce-scattered into the persistent shard once per
  micro-batch, so the peak adds to the shard only the buckets a backward holds in full
  (:func:`grad_round_bytes`); between steps only the shard (:func:`state_bytes`). With
  ``--optimizer-cpu-offload`` the device keeps ``1 - F`` of the optimizer bytes and the
  host ``16 F / D`` per parameter (fp32 master, a gradient copy, two moments):
  ``host``, not part of the device total.
* **activations** -- what autograd keeps for backward, per layer and micro-batch
  (:func:`layer_activation_elements`, counted from megalite's layers: the saved inputs of
  the norms, linears, attention kernel and activation function), times the peak number of
  (micro-batch, chunk) pairs the pipeline schedule keeps in flight on this rank
  (:func:`megalite.planner.schedule.peak_in_flight`); on the output stage (the last, or
  rank 0 under a V schedule) also what the multi-token prediction depths keep
  (:func:`mtp_activation_bytes`) for each micro-batch the output chunk holds in flight. Under
  ``--fp8-format`` (:mod:`megalite.planner.fp8_memory`) the fp8 linears' inputs as they
  keep them (one byte per element under the per-tensor recipes with fp8 weight gradients,
  :func:`~megalite.planner.fp8_memory.fp8_linear_input`) and, per step, the fp8 weight
  copies (:func:`~megalite.planner.fp8_memory.fp8_weight_copies`, the routed experts'
  :func:`~megalite.planner.fp8_memory.fp8_expert_weight_copies`; under ZeRO-3 the
  gathered units' only, :func:`~megalite.planner.fp8_memory.fp8_step_copies`).
* **transient** -- the largest working set on top of the saved activations: the backward
  of one layer (gradient of the MLP's widest tensor plus the layer's input gradient), on
  the last stage the logits and the cross entropy's fp32 copy of them (where the peak of
  a step usually is: every activation of the micro-batch is still held), under full
  recomputation one recomputed unit's activations, and under ``--qk-clip`` the
  largest-logit pass's scores and fp32 copies (:func:`megalite.planner.qk_clip.
  transient_bytes`; it keeps nothing for backward).
* **comm buffers** -- pipeline transfers of one round (an activation and a gradient
  each way on a middle stage or any stage of an interleaved pipeline, one way on the first
  and last stages of 1F1B), the
  tensor-parallel collectives' buffers (a whole ``[s, b, h]`` activation, two under
  sequence parallelism).
* **gathered params** -- the distributed optimizer's parameter all-gather writes into the
  parameters themselves (nothing extra); under optim_grads_params (ZeRO-3: parameters
  sharded, ``2 / D`` bytes each between steps) the full copies of the running unit and
  of the prefetched one (:mod:`megalite.optim.param_sharding`): the two largest of this
  stage's units (:func:`unit_params`: each layer, the embedding, the output layer). On
  CPU (``device_type="cpu"``) one more: gloo's all-gather into a tensor gathers into a
  flat buffer of the output's size that it allocates for the collective and copies out
  of at its end (NCCL writes into the output), so the prefetched unit's gather in flight
  holds a second copy of it.
* **reused** (``device_type="cpu"`` only) -- storage megalite keeps from step to step on
  CPU instead of allocating it afresh (:mod:`megalite.layers.reused_buffer`): the
  embedding's and the output layer's ``[V/tp, h]`` weight gradients, held through the
  whole step from the second step on, and the output layer's logits ``[tokens, V/tp]``,
  held while the layers run backward (the output layer's only without sequence
  parallelism). On a GPU the caching allocator reuses storage
  itself and megalite keeps nothing (0).

Elements are multiplied by the activation dtype's bytes (4 fp32, 2 bf16/fp16); softmax
statistics and the cross entropy's probabilities are fp32 whatever the dtype, fp8 copies
one byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megalite.config.layout import resolve_layout
from megalite.config.shapes import (dense_layer_params, dense_mlp_params, fp8_layer,
                                    is_moe_layer, layer_gemms, moe_mlp_params,
                                    mtp_depth_params, mtp_depths, norm_params)
from megalite.optim.algorithms import algorithm_of
from megalite.optim.data_parallel import bucket_elements
from megalite.optim.memory import expected_bytes_per_param
from megalite.planner import muon, qk_clip
from megalite.planner.fp8_memory import cpu_fp8_gemm_bytes, fp8_linear_input, fp8_step_copies
from megalite.planner.schedule import output_stage, peak_in_flight, stage_layers


# the busiest expert-parallel rank receives this many times the average routed tokens
# (dropless routing is not balanced: at initialisation and under a weak aux loss)
MOE_IMBALANCE = 1.25


@dataclass
class MemoryEstimate:
    """Bytes per rank by term; ``params_elements``: parameter elements of this rank."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    comm_buffers: float
    gathered_params: float
    params_elements: int
    in_flight: int
    notes: list = field(default_factory=list)
    host: float = 0.0      # optimizer bytes in host memory (--optimizer-cpu-offload)
    reused: float = 0.0    # buffers kept between steps on CPU (layers.reused_buffer)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations
                + self.transient + self.comm_buffers + self.gathered_params + self.reused)

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "transient": self.transient,
                "comm_buffers": self.comm_buffers, "gathered_params": self.gathered_params,
                "reused": self.reused, "total": self.total, "host": self.host}


def stage_param_counts(m, p, pp_rank: int) -> tuple[int, int]:
    """(dense, expert) parameter elements held by pipeline rank ``pp_rank`` (any tp rank):
    its layers, the embedding tables on the first stage, the final norm and output layer
    (a copy of the tied embedding when pp > 1) on the last stage (the first under ZB-V)."""
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    dense = expert = 0
    for layer in stage_layers(m, p, pp_rank):
        dense += dense_layer_params(m, tp)
        if is_moe_layer(m, layer):
            d, e = moe_mlp_params(m, tp, ep, etp)
            dense, expert = dense + d, expert + e
        else:
            dense += dense_mlp_params(m, tp)
    vocab = m.padded_vocab_size(tp)
    if pp_rank == 0:
        dense += vocab * m.hidden_size // tp
        if m.learned_positions:
            dense += m.max_position_embeddings * m.hidden_size
    if pp_rank == output_stage(p):
        dense += norm_params(m)
        if m.untie_embeddings_and_output_weights or pp > 1:
            dense += vocab * m.hidden_size // tp
        depths = mtp_depths(m)   # the prediction depths, and on a later stage with an
        if depths:               # untied output layer a copy of the word embedding too
            d, e = mtp_depth_params(m, tp, ep, etp)
            dense, expert = dense + depths * d, expert + depths * e
            if pp > 1 and m.untie_embeddings_and_output_weights:
                dense += vocab * m.hidden_size // tp
    return dense, expert


def unit_params(m, p, pp_rank: int) -> list[int]:
    """Parameter elements of each unit ZeRO-3 gathers at once on pipeline rank ``pp_rank``
    (one tp / ep slice): each transformer layer, the embedding tables on the first stage,
    the output layer (with the final norm) on the last."""
    tp, ep, etp = p.tensor_model_parallel_size, p.expert_model_parallel_size, \
        p.expert_tensor_parallel_size
    units = []
    for layer in stage_layers(m, p, pp_rank):
        n = dense_layer_params(m, tp)
        if is_moe_layer(m, layer):
            n += sum(moe_mlp_params(m, tp, ep, etp))
        else:
            n += dense_mlp_params(m, tp)
        units.append(n)
    vocab = m.padded_vocab_size(tp) * m.hidden_size // tp
    if pp_rank == 0:
        units.append(vocab + (m.max_position_embeddings * m.hidden_size
                              if m.learned_positions else 0))
    pp = p.pipeline_model_parallel_size
    if pp_rank == output_stage(p):
        units.append(vocab + norm_params(m))
        if mtp_depths(m):   # the depths gather as one unit (the chunk's other parameters)
            units.append(mtp_depths(m) * sum(mtp_depth_params(m, tp, ep, etp)))
            if pp > 1 and m.untie_embeddings_and_output_weights:
                units.append(vocab)   # the stage's copy of the word embedding
    return units


def layer_activation_elements(m, p, micro_batch: int, moe: bool = False,
                              fp8: bool = False) -> dict:
    """Elements one transformer layer keeps for backward for one micro-batch, by dtype:
    ``{"act": elements in the compute dtype, "fp32": elements always fp32, "fp8":
    elements of one byte}``; the layer's input is included, its output is not (it is the
    next layer's input).

    Sequence ``S = seq / cp`` per rank; ``h``-sized tensors on the residual stream are
    split over tp under sequence parallelism, and so are the norm outputs feeding the
    column-parallel linears (they keep their ``[s/tp, b, h]`` input and gather it again
    in backward); heads and ffn are split over tp.

    ``fp8``: the layer runs its tensor-parallel linears in fp8
    (:func:`megalite.config.shapes.fp8_layer`; :mod:`megalite.layers.fp8.gemm`), which
    keep their inputs as :func:`fp8_linear_input` says -- whole (gathered under sequence
    parallelism, not this rank's ``s/tp``): attention's qkv and output projections, the
    dense MLP's fc1 (unless ``--recompute-modules mlp`` keeps only its input) and fc2, the
    shared expert's. Multi-latent attention: its output projection (its up projections
    are counted as in the training dtype)."""
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    sp = tp if p.sequence_parallel else 1
    tokens = m.seq_length // cp * micro_batch
    h, nh, ng, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    stats = 1 if m.normalization == "RMSNorm" else 2
    act = fp32 = low = 0

    def linear_input(own: int, whole: int) -> int:
        """Adds what a linear keeps of its input to ``low`` and returns the training-dtype
        elements: ``own`` without fp8, else :func:`fp8_linear_input` of ``whole``."""
        nonlocal low
        if not fp8:
            return own
        high, one_byte = fp8_linear_input(m, whole)
        low += one_byte
        return high

    def attention_output(elements: int) -> int:
        """The output projection's input: the attention kernel's output, which the kernel
        keeps for its own backward (its storage; under ``--recompute-modules core_attn``
        the checkpoint keeps nothing inside); an fp8 projection keeps its quantisation
        beside it (its unquantised input is that same storage)."""
        if m.recomputes("core_attn"):
            return linear_input(elements, elements)
        linear_input(elements, elements)
        return elements

    # residual stream: layer input (saved by input norm), mid-layer sum (pre-MLP norm)
    act += 2 * tokens * h // sp
    fp32 += 2 * stats * tokens // sp
    # normed inputs of qkv and fc1 (this rank's [s/tp, b, h] under sp)
    if m.multi_latent_attention:   # the normed input of its replicated down projections
        act += tokens * h // sp
    else:
        act += linear_input(tokens * h // sp, tokens * h)
    if m.multi_latent_attention:
        a, f32 = mla_activation_elements(m, tokens, tp, sp)
        proj = tokens * nh * m.v_head_dim // tp                  # attention output
        act, fp32 = act + a - proj + attention_output(proj), fp32 + f32
    else:
        act += tokens * (nh + 2 * ng) * d // tp               # q, k, v (views of qkv)
        if m.position_embedding_type == "rope":
            act += tokens * (nh + ng) * d // tp               # rotated q, k
        proj = tokens * nh * d // tp
        act += attention_output(proj)                         # attention output (proj input)
        if m.qk_layernorm:
            act += tokens * (nh + ng) * d // tp               # normed q, k
            fp32 += tokens * (nh + ng) * stats // tp
    fp32 += tokens * nh // tp                                 # softmax log-sum-exp
    if m.hidden_dropout > 0:
        act += 2 * tokens * h // sp // m.params_dtype.itemsize  # bool masks, 1 byte
    if not moe:
        f = m.ffn_hidden_size // tp
        if m.recomputes("mlp"):       # only its input is kept
            return {"act": act + tokens * h // sp, "fp32": fp32, "fp8": low}
        act += linear_input(tokens * h // sp, tokens * h)     # fc1 in
        act += tokens * f * (2 if m.swiglu else 1)            # fc1 out
        act += linear_input(tokens * f, tokens * f)           # fc2 in
        return {"act": act, "fp32": fp32, "fp8": low}
    # MoE: tokens split over tp inside the layer, routed top-k to local experts
    etp = p.expert_tensor_parallel_size
    local = tokens // tp
    k, f = m.moe_router_topk, m.moe_ffn_hidden_size // etp
    act += local * h * (1 if sp > 1 else 2)                   # router / dispatcher input
    fp32 += local * m.num_experts * 3                         # router logits, probs, top-k
    if m.recomputes("moe"):   # dispatch and experts run again in backward: input only
        return {"act": act, "fp32": fp32, "fp8": low}
    # tokens this rank's experts see: the average, times an allowance for the imbalance of
    # dropless routing (the capacity factor when tokens are dropped)
    imbalance = m.moe_expert_capacity_factor or MOE_IMBALANCE
    routed = int(local * k * etp * imbalance)
    act += routed * h * 2                                     # permuted, expert fc1 input
    act += routed * f * (3 if m.swiglu else 2)
    act += routed * h                                         # expert outputs (combine)
    shared = m.moe_shared_expert_intermediate_size
    if shared:   # fc1 out; fc2 in; fc1 in
        act += tokens * shared // tp * (2 if m.swiglu else 1)
        act += linear_input(tokens * shared // tp, tokens * shared // tp)
        act += linear_input(tokens * h, tokens * h)
    return {"act": act, "fp32": fp32, "fp8": low}


def mla_activation_elements(m, tokens: int, tp: int, sp: int) -> tuple[int, int]:
    """(compute-dtype, fp32) elements multi-latent attention keeps for backward beyond its
    normed input: the latents (this rank's ``s/tp`` tokens under sp) and their norms, the
    gathered RoPE key, the up projections' outputs and RoPE (not kept when
    ``--recompute-modules mla_up_proj`` recomputes them), the queries, keys and values the
    kernel keeps (not kept when ``core_attn`` is recomputed too) and the attention output."""
    n, dq, dr, dv = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    stats = 1 if m.normalization == "RMSNorm" else 2
    rq, rkv = m.q_lora_rank or 0, m.kv_lora_rank
    act = tokens * (2 * rq + 2 * rkv + dr) // sp + tokens * dr      # latents, normed, k_pe
    fp32 = tokens * 2 * stats // sp if m.qk_layernorm else 0
    up = m.recomputes("mla_up_proj")
    core = m.recomputes("core_attn")
    if not up:
        act += tokens * n * (2 * dq + dr + dv) // tp              # q and kv up outputs
        act += tokens * (n + 1) * dr // tp                        # rotated RoPE parts
    if not (up and core):
        act += tokens * n * (2 * (dq + dr) + dv) // tp            # query, key, value
    act += tokens * n * dv // tp                                  # attention output
    return act, fp32


def mtp_activation_bytes(m, p, mb: int, tokens: int, vocab: int, eb: int) -> float:
    """Bytes the multi-token prediction depths of one micro-batch keep for backward on the
    last stage: per depth its embedding, the two normed halves and their concatenation
    (``[s, b, 2h]``), its transformer layer (of the last layer's kind; only its input under
    full recomputation), the final norm's output, and its logits with the cross entropy's
    fp32 softmax (kept from the depth's forward to the backward)."""
    depths = mtp_depths(m)
    if not depths:
        return 0.0
    tp = p.tensor_model_parallel_size
    sp = tp if p.sequence_parallel else 1
    h = m.hidden_size
    if m.recompute_granularity == "full":
        layer = tokens * h // sp * eb
    else:
        layer = _layer_bytes(m, p, mb, m.num_layers - 1, eb)   # the last layer's kind
    per_depth = (tokens * h // sp * (1 + 2 + 2 + 1) * eb + layer
                 + tokens * vocab // tp * (eb + 4))
    return depths * per_depth


def _layer_bytes(m, p, mb: int, layer: int, dtype_bytes: int) -> float:
    """Bytes global layer ``layer`` keeps for backward for one micro-batch."""
    e = layer_activation_elements(m, p, mb, is_moe_layer(m, layer), fp8_layer(m, layer))
    return e["act"] * dtype_bytes + e["fp32"] * 4 + e["fp8"]


def estimate_memory(cfg, world_size: int, pp_rank: int | None = None,
                    device_type: str = "cuda") -> MemoryEstimate:
    """Estimated peak bytes of one rank of ``cfg`` (validated for ``world_size``) on
    pipeline stage ``pp_rank``; None: the stage with the largest total. ``device_type``
    "cpu" adds the buffers megalite keeps between steps on CPU (``reused``)."""
    p = cfg.parallel
    if pp_rank is None:
        stages = [estimate_memory(cfg, world_size, r, device_type)
                  for r in range(p.pipeline_model_parallel_size)]
        return max(stages, key=lambda s: s.total)
    m, lay = cfg.model, resolve_layout(cfg, world_size)
    tp, pp = lay.tp, lay.pp
    eb = lay.dtype_bytes
    strategy = lay.strategy
    state = state_bytes(cfg, world_size, pp_rank)
    params, optimizer = state["params"], state["optimizer"]
    grads = state["grads"]
    if strategy in ("optim_grads", "optim_grads_params"):   # the buckets in a backward
        grads += grad_round_bytes(cfg, lay, pp_rank)
    notes = []

    mb, vpp = lay.micro_batch_size, lay.vpp
    layers = lay.stage_layers(pp_rank)
    tokens = lay.tokens_per_microbatch
    sp = lay.sp
    h = m.hidden_size
    layer_bytes = [_layer_bytes(m, p, mb, layer, eb) for layer in layers]
    full = m.recompute_granularity == "full"
    if full:  # each recompute unit keeps its input only; one unit recomputed at a time
        unit = m.recompute_num_layers or 1
        if m.recompute_method == "block":
            kept = layer_bytes[unit:]
            saved = sum(kept) + min(unit, len(layers)) * tokens * h // sp * eb
            recompute = max(layer_bytes[:unit], default=0) * min(unit, len(layers))
        else:
            n_units = -(-len(layers) // unit)
            saved = n_units * tokens * h // sp * eb
            recompute = max(layer_bytes, default=0) * min(unit, len(layers))
    else:
        saved, recompute = sum(layer_bytes), 0
    chunk_bytes = saved / vpp          # one (micro-batch, chunk) pair
    in_flight = peak_in_flight(pp, pp_rank, lay.num_microbatches, vpp,
                               lay.pipeline_schedule)
    activations = chunk_bytes * in_flight + fp8_step_copies(m, p, pp_rank, strategy)
    first, last = pp_rank == 0, pp_rank == output_stage(p)
    vocab = lay.padded_vocab_size
    if last:  # final norm input and output (the output layer's input)
        activations += 2 * tokens * h // sp * eb
        # the depths run in the output chunk only (the last one; chunk 1 of rank 0 in a V)
        activations += mtp_activation_bytes(m, p, mb, tokens, vocab, eb) * (peak_in_flight(
            pp, pp_rank, lay.num_microbatches, vpp, lay.pipeline_schedule, chunk=vpp - 1)
            if mtp_depths(m) else 0)
    # working sets on top of the saved activations (the largest one)
    f = max(m.ffn_hidden_size, m.moe_ffn_hidden_size or 0) // tp * (2 if m.swiglu else 1)
    backward = tokens * (f + 2 * h) * eb + recompute
    if sp > 1:   # a column-parallel linear's input, gathered again for its weight gradient
        backward += tokens * h * eb
    if device_type == "cpu":   # torch._scaled_mm's fp32 copies of its operands there
        backward += cpu_fp8_gemm_bytes(m, tp, tokens, layers)
    loss = tokens * vocab // tp * (eb + 4) if last else 0  # logits, fp32 shifted logits
    # --qk-clip: the largest-logit pass in a layer's forward (scores, fp32 q and k copies)
    logits = qk_clip.transient_bytes(m, tp, lay.cp, mb, eb)
    transient = max(backward, loss, logits)
    # on CPU the kept logits storage is held while the layers run backward
    kept_logits = max(0, backward + tokens * vocab // tp * eb - transient) \
        if last and sp == 1 else 0
    if first:
        transient += tokens * h // sp * eb                       # embedding output
    comm = 0.0
    if pp > 1:  # a round's receives and sends (batch_isend_irecv): activation and grad
        # each way on a middle stage, one way on the first and last
        comm += (2 if (first or last) and vpp == 1 else 4) * tokens * h // sp * eb
    if tp > 1:  # tp collectives: all-gather output + reduce-scatter input (sp), or the
        comm += tokens * h * eb * (2 if sp > 1 else 1)            # all-reduce's buffer
    gathered = 0.0
    if strategy == "optim_grads_params":   # the running unit and the prefetched one
        units = sorted(unit_params(m, p, pp_rank), reverse=True)
        gathered = sum(units[:2]) * eb
        if device_type == "cpu":   # gloo's staging copy of the prefetch's gather
            gathered += units[0] * eb
    if device_type == "cpu" and m.normalization == "RMSNorm":
        activations += cpu_rms_norm_bytes(m, lay, layers, in_flight, last)
    reused = 0.0
    if device_type == "cpu":   # layers.reused_buffer: weight gradients, kept logits
        embeds = first or (last and bool(mtp_depths(m)))   # a later stage's copy
        reused = vocab // tp * h * eb * (embeds + (last and sp == 1)) + kept_logits
    return MemoryEstimate(params=params, grads=grads, optimizer=optimizer,
                          activations=activations, transient=transient, comm_buffers=comm,
                          gathered_params=gathered, params_elements=state["elements"],
                          in_flight=in_flight, notes=notes, host=state["host"],
                          reused=reused)


def cpu_rms_norm_bytes(m, lay, layers: list, in_flight: int, last: bool) -> float:
    """What RMSNorm keeps for backward on a CPU beyond a GPU's: torch runs ``F.rms_norm``
    there as its composite (``x * rsqrt(mean(x^2) + eps) * w``), whose autograd keeps the
    normalised ``[s/sp, b, h]`` for the weight's gradient, where CUDA's fused kernel keeps
    only the input and the ``[s, b]`` reciprocal. In bf16 / fp16 the composite computes in
    fp32 and keeps, per element, the fp32 copy of its input and the fp32 normalised beside
    the normalised cast back to the training dtype (4 + 4 + 2 bytes; measured on a
    Llama-style model in bf16: 64 + 64 + 32 KiB per ``[s, b, h]`` of 16 K elements). Per
    layer the input and pre-MLP norms (and the query and key norms under
    ``--qk-layernorm``), for each (micro-batch, chunk) in flight, the layers inside a
    full-recompute unit excepted; the final norm once on the output stage."""
    eb, tp = lay.dtype_bytes, lay.tp
    kept_bytes = eb if eb == 4 else 4 + 4 + eb
    tokens, h = lay.tokens_per_microbatch, m.hidden_size
    per_layer = 2 * tokens * h // lay.sp
    if m.qk_layernorm and not m.multi_latent_attention:
        per_layer += tokens * (m.num_attention_heads + m.num_query_groups) * m.kv_channels // tp
    kept = 0 if m.recompute_granularity == "full" else len(layers)
    return (kept * per_layer * in_flight / lay.vpp
            + (tokens * h // lay.sp if last else 0)) * kept_bytes


def grad_round_bytes(cfg, lay, pp_rank: int = 0) -> float:
    """optim_grads / optim_grads_params: bytes of the full gradients a backward holds at
    once on stage ``pp_rank`` of ``cfg`` (resolved as ``lay``;
    :mod:`megalite.optim.grad_buffer`'s rounds): per gradient buffer (dense, expert) the
    bucket being filled and, with ``--overlap-grad-reduce``, the one being
    reduce-scattered. A bucket holds ``--ddp-bucket-size`` elements (the
    default of :func:`megalite.optim.data_parallel.bucket_elements`) or one larger
    parameter (the largest: the vocabulary table on the first and output stages, else a
    layer's widest linear), within the stage's elements and, under optim_grads_params,
    within one gathered unit."""
    m, p = cfg.model, cfg.parallel
    grad_bytes = 2 if p.grad_reduce_in_bf16 else 4
    largest = max(i * o for _t, i, o in layer_gemms(m, 1, lay.tp))
    if pp_rank in (0, output_stage(p)):
        largest = max(largest, m.padded_vocab_size(lay.tp) * m.hidden_size // lay.tp)
    bucket = max(bucket_elements(p.ddp_bucket_size, lay.dp * lay.cp), largest)
    if lay.strategy == "optim_grads_params":
        bucket = min(bucket, max(unit_params(m, p, pp_rank)))
    held = 2 if p.overlap_grad_reduce else 1
    return sum(held * min(n, bucket) for n in stage_param_counts(m, p, pp_rank)
               if n) * grad_bytes


def state_bytes(cfg, world_size: int, pp_rank: int = 0) -> dict:
    """Bytes of parameters, gradients and optimizer state one rank of stage ``pp_rank``
    holds between steps, as :func:`megalite.optim.memory.rank_memory` measures them:
    ``{"params", "grads", "optimizer", "host", "elements"}``; ``host`` the
    optimizer bytes ``--optimizer-cpu-offload`` keeps in host memory (a fraction ``F`` of
    the shard's elements: fp32 master, gradient copy and Adam's two moments, 16 bytes
    each). Under Muon its matrices keep one fp32 state tensor (the momentum) and the other
    parameters the scalar optimizer's (:func:`megalite.planner.muon.stage_elements`);
    under Lion the linear weights (the matrices, routers, learned position embeddings) one
    and the rest AdamW's two; spread over a sharded optimizer's ranks in proportion."""
    m, p, o = cfg.model, cfg.parallel, cfg.optim
    lay = resolve_layout(cfg, world_size)
    half = m.bf16 or m.fp16
    grad_bytes = 2 if p.grad_reduce_in_bf16 else 4
    offload = o.optimizer_offload_fraction if getattr(o, "optimizer_cpu_offload", False) \
        else 0.0
    out = dict.fromkeys(("params", "grads", "optimizer", "host"), 0.0)
    dense, expert = stage_param_counts(m, p, pp_rank)
    algorithm = algorithm_of(o)
    rules = algorithm.rules(o)
    # the main rule's elements: Muon's matrices, or Lion's linear weights
    matrices = (muon.stage_elements(cfg, lay, pp_rank, lion=not algorithm.orthogonal)
                if len(rules) > 1 else (0, 0))
    for n, group, main in ((dense, lay.dp * lay.cp, matrices[0]),
                           (expert, lay.edp, matrices[1])):
        # (elements, fp32 state tensors of each): the main rule's and the rest's
        parts = ([(main, algorithm.state_floats(o, rules[0])),
                  (n - main, algorithm.state_floats(o, rules[1]))]
                 if len(rules) > 1 else [(n, algorithm.state_floats(o))])
        for count, floats in parts:
            optim_bytes = 4 * floats + (4 if half else 0)
            host_bytes = 4 * floats + 8   # + master (fp32 runs too) and grad
            per = expected_bytes_per_param(lay.strategy, group, lay.dtype_bytes, grad_bytes,
                                           optim_bytes)
            out["params"] += count * per["params"]
            out["grads"] += count * per["grads"]
            out["optimizer"] += count * per["optimizer"] * (1 - offload)
            out["host"] += count * host_bytes / group * offload
    out["elements"] = dense + expert
    return out
