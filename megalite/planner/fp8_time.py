"""What ``--fp8-format`` costs in the step time besides its GEMMs' FLOPs at the fp8 rate
(:func:`megalite.planner.time.compute_seconds` adds these terms):

* **the GEMMs' rate** (:func:`gemm_seconds`): each fp8 linear runs three GEMMs (fprop,
  dgrad, wgrad; :mod:`megalite.layers.fp8.gemm`), each a third of its ``6 N`` FLOPs per
  token. The per-tensor recipes run all three with the fp8 kernel. ``blockwise`` has a
  kernel (torch's 1 x 128 block-scaled GEMM) only where :attr:`Cluster.fp8_block_kernel`
  (Hopper) and only for e4m3 operands: every GEMM under ``--fp8-format e4m3``, the fprop
  alone under ``hybrid`` (its gradients are e5m2). ``mxfp8`` has no kernel megalite
  calls. A GEMM without a kernel is emulated: the dequantised operands multiplied in
  fp32, at ``fp32_flops``. Under ``--no-fp8-wgrad`` the wgrad GEMM runs in the training
  dtype (:func:`fp8_gemm_flops_per_token` leaves it out).
* **quantisation traffic** (:func:`quantize_seconds`): per micro-batch the passes that
  turn each fp8 linear's input ``x`` and output gradient ``dy`` into fp8
  (:func:`activation_quantize_bytes`), per step the weights' (:func:`weight_quantize_bytes`),
  at ``Cluster.memory_rate``. The GEMMs' own reads of the fp8 operands are in the GEMM time.
"""

from __future__ import annotations

from megalite.config.shapes import fp8_layer, is_moe_layer, layer_gemms
from megalite.layers.fp8.recipes import BLOCK_RECIPES
from megalite.planner.fp8_memory import fp8_linear_weights

SCALE_BYTES = 1 / 32   # block scales per element: one e8m0 byte per 32 elements (mxfp8),
                       # one fp32 per 128 (blockwise)
GEMMS = ("fprop", "dgrad", "wgrad")


def fp8_gemm_flops_per_token(m) -> float:
    """Training FLOPs per token of the GEMMs that ``--fp8-format`` runs in fp8: each
    transformer layer's tensor-parallel linears (attention's qkv and output projections,
    or multi-latent attention's up and output projections; the dense MLP or the shared
    expert), the layers kept in bf16 (``--first-last-layers-bf16``) excepted; ``2`` per
    weight for each of the forward, input-gradient and weight-gradient GEMMs (``6``; ``4``
    under ``--no-fp8-wgrad``, whose weight gradient runs in the training dtype); 0 without
    fp8."""
    if m.fp8_format is None:
        return 0.0
    return 2.0 * len(fp8_gemms(m)) * fp8_weights(m)


def fp8_weights(m) -> int:
    """Weight elements of the fp8 linears of all fp8 layers (whole, over all tp ranks)."""
    return sum(fp8_linear_weights(m, layer) for layer in range(m.num_layers)
               if fp8_layer(m, layer))


def fp8_gemms(m) -> tuple[str, ...]:
    """The GEMMs of an fp8 linear that run on fp8 operands: all three, or fprop and dgrad
    under ``--no-fp8-wgrad``."""
    return GEMMS if m.fp8_wgrad else GEMMS[:2]


def emulated_gemms(m, cluster) -> frozenset[str]:
    """Which of an fp8 linear's GEMMs (names of :data:`GEMMS`) have no fp8 kernel on
    ``cluster`` and run as an fp32 product of the dequantised operands
    (:func:`megalite.layers.fp8.gemm.block_mm`): none under tensorwise and delayed; all
    under mxfp8 (its kernel needs compute capability 10.0, not called); under blockwise
    none with e4m3 operands on a GPU with the 1 x 128 block-scaled kernel
    (:attr:`Cluster.fp8_block_kernel`), dgrad and wgrad (e5m2 gradients) under hybrid
    there, all three elsewhere."""
    if m.fp8_recipe == "mxfp8" or (m.fp8_recipe == "blockwise"
                                   and not cluster.fp8_block_kernel):
        return frozenset(GEMMS)
    if m.fp8_recipe == "blockwise" and m.fp8_format == "hybrid":
        return frozenset(GEMMS[1:])
    return frozenset()


def gemm_seconds(ctx) -> tuple[float, float]:
    """(FLOPs of the step's fp8 GEMMs, whole model, each counted by the caller among the
    training-dtype FLOPs; seconds this rank takes for its share of them): fprop (again in
    the recomputed forward under full recomputation), dgrad and wgrad (not under
    ``--no-fp8-wgrad``) at ``fp8_flops``, or at ``fp32_flops`` (``peak_flops`` where 0)
    those of :func:`emulated_gemms`, each ``x matmul_efficiency``. (0, 0) without fp8 or
    on a cluster without fp8 GEMMs (all at the training dtype's rate). Selective
    recomputation's fp8 forwards stay at the training dtype's rate."""
    m, lay, cluster = ctx.cfg.model, ctx.lay, ctx.cluster
    if m.fp8_format is None or not cluster.fp8_flops:
        return 0.0, 0.0
    one = 2.0 * fp8_weights(m) * lay.tokens_per_step   # FLOPs of one GEMM kind
    emulated = emulated_gemms(m, cluster)
    fp32 = cluster.fp32_flops or cluster.peak_flops
    flops = seconds = 0.0
    for gemm in fp8_gemms(m):
        count = one * (ctx.passes - 1 if gemm == "fprop" else 1)
        flops += count
        seconds += count / (fp32 if gemm in emulated else cluster.fp8_flops)
    return flops, seconds / lay.world_size / cluster.matmul_efficiency


def fp8_linear_gemms(m, layer: int, tokens: int, tp: int = 1) -> list[tuple[int, int, int]]:
    """``(M, K, N)`` of each linear ``--fp8-format`` runs in fp8 in global layer ``layer``
    on one tp rank (``x [M, K]``, weight ``[N, K]``, ``dy [M, N]``; ``M`` = ``tokens``,
    whole under sequence parallelism as :func:`~megalite.config.shapes.layer_gemms`
    counts): those of :func:`~megalite.planner.fp8_memory.fp8_linear_weights` -- qkv and
    the output projection (multi-latent attention: the query and key/value up projections
    and the output projection), then the dense MLP's or the shared expert's fc1 and fc2;
    empty for a layer kept in bf16."""
    if not fp8_layer(m, layer):
        return []
    ffn = (m.moe_shared_expert_intermediate_size or 0) if is_moe_layer(m, layer) \
        else m.ffn_hidden_size
    return layer_gemms(m, tokens, tp, ffn=ffn, down=False)


def _cast_read(m, dtype_bytes: int) -> float:
    """Bytes read per element by one per-tensor quantisation: tensorwise an amax pass and
    a cast pass (``2 b``), delayed the cast pass alone (its scale from the history, the
    amax recorded in the same pass: ``b``)."""
    return (2 if m.fp8_recipe == "tensorwise" else 1) * dtype_bytes


def activation_quantize_bytes(m, tp: int, tokens: int, dtype_bytes: int,
                              forwards: int = 1) -> float:
    """Bytes of memory traffic, per micro-batch of ``tokens`` tokens on one tp rank, of
    quantising the inputs ``x [M, K]`` and output gradients ``dy [M, N]`` of every fp8
    linear of the model (all layers; the caller divides by the pipeline stages), with
    ``forwards`` forward passes (2 under full recomputation) and ``dtype_bytes`` (``b``)
    per element of the training dtype:

    * per-tensor recipes, per quantisation: reads :func:`_cast_read`, writes one byte per
      layout made -- ``x`` in each forward into ``qx [M, K]`` and, with fp8 weight
      gradients, ``qx_t [K, M]``; ``dy`` into ``qg`` and, with fp8 weight gradients,
      ``qg_t``. One ``qx_t`` write is left out: it is the first of the four passes over
      the saved fp8 input that the memory-bound term counts
      (:func:`~megalite.planner.memory.layer_activation_elements`);
    * block recipes: each operand quantised along each GEMM's contraction dimension it
      enters (``x`` along K per forward and along M for wgrad, ``dy`` along N and along
      M; the wgrad ones not under ``--no-fp8-wgrad``), each reading ``b`` and writing
      ``1 + 1/32`` bytes per element (the fp8 values and :data:`SCALE_BYTES`).

    0 without fp8."""
    if m.fp8_format is None:
        return 0.0
    wgrad = int(m.fp8_wgrad)
    if m.fp8_recipe in BLOCK_RECIPES:
        per_pass = dtype_bytes + 1 + SCALE_BYTES
        x_bytes = (forwards + wgrad) * per_pass
        dy_bytes = (1 + wgrad) * per_pass
    else:
        read = _cast_read(m, dtype_bytes)
        x_bytes = forwards * (read + 1 + wgrad) - wgrad
        dy_bytes = read + 1 + wgrad
    total = 0.0
    for layer in range(m.num_layers):
        for mm, k, n in fp8_linear_gemms(m, layer, tokens, tp):
            total += mm * k * x_bytes + mm * n * dy_bytes
    return total


def weight_quantize_bytes(m, weights: float, dtype_bytes: int, microbatches: int,
                          passes: int = 2, zero3: bool = False, shards: int = 1) -> float:
    """Bytes of memory traffic per training step of quantising ``weights`` local weight
    elements of fp8 linears (:class:`~megalite.layers.fp8.scaling.StepWeights`), with
    ``microbatches`` micro-batches of ``passes`` passes each (forward, backward; 3 under
    full recomputation) and ``dtype_bytes`` (``b``) per element of the weights:

    * per-tensor recipes: one quantisation per step (reads :func:`_cast_read`, writes 1)
      and one transposed copy for dgrad (reads 1, writes 1). Delayed scaling also reads
      the weight for its amax at every later forward that reuses the copy (``b`` each).
      Under ``--fp8-param-gather`` (``shards``: the dp x cp ranks sharing the weights)
      each owner quantises its shard alone, once per step, and no amax is read again;
    * block recipes: two quantisations per step (along K for fprop, of the transpose along
      N for dgrad), each reading ``b`` and writing ``1 + 1/32``.

    Under ZeRO-3 (``zero3``) a unit's copies are forgotten when it is freed, so they are
    made again after every gather: a quantisation per pass and micro-batch (none under
    ``--fp8-param-gather``, which sends the step's fp8 row at every gather) and a
    transposed copy per backward. 0 without fp8."""
    if m.fp8_format is None:
        return 0.0
    casts = passes * microbatches if zero3 else 1
    if m.fp8_recipe in BLOCK_RECIPES:
        return weights * (casts if zero3 else 2) * (dtype_bytes + 1 + SCALE_BYTES)
    transposes = microbatches if zero3 else 1
    cast = _cast_read(m, dtype_bytes) + 1
    if m.fp8_param_gather:
        return weights * (cast / shards + 2 * transposes)
    reuses = 0 if zero3 or m.fp8_recipe != "delayed" else (passes - 1) * microbatches - 1
    return weights * (casts * cast + 2 * transposes + reuses * dtype_bytes)


def quantize_seconds(ctx) -> float:
    """Seconds per step on one rank of the fp8 quantisation traffic at ``memory_rate``: the
    micro-batches' (:func:`activation_quantize_bytes`) and the step's weights'
    (:func:`weight_quantize_bytes`), over this rank's share of the layers (the model's
    over the pipeline stages, as the memory-bound term counts); 0 without fp8."""
    m, lay = ctx.cfg.model, ctx.lay
    if m.fp8_format is None:
        return 0.0
    act = activation_quantize_bytes(m, lay.tp, ctx.tokens, lay.dtype_bytes, ctx.passes - 1)
    weights = weight_quantize_bytes(
        m, fp8_weights(m) / lay.tp, lay.dtype_bytes, lay.num_microbatches, ctx.passes,
        lay.strategy == "optim_grads_params", lay.dp * lay.cp)
    return (act * lay.num_microbatches + weights) / lay.pp / ctx.cluster.memory_rate
