"""Step time of a layout: compute, communication per parallelism, pipeline bubble, MFU.

Per step (one global batch), for one rank (all ranks do the same work, up to the
pipeline's first and last stage):

Each term is one function over a :class:`StepContext` (the config, its resolved layout
and the cluster): :func:`compute_seconds`, one cost function per parallelism in
:data:`COSTS` (a new parallelism adds a function and a line there) and
:func:`optimizer_seconds`; :func:`estimate_time` adds them up.

* **compute** -- the model FLOPs of the step (``ResolvedLayout.model_flops_per_step``:
  :func:`megalite.config.shapes.flops_per_token` of the active parameters: top-k
  experts, not all) divided over the ``world`` ranks, plus what recomputation adds
  (full: the forward again, 2N per token of the layers; selective: the attention core's
  forward, 4 L h s per token), at ``peak_flops x matmul_efficiency``; under
  ``--fp8-format`` (:mod:`megalite.planner.fp8_time`) the GEMMs megalite runs in fp8
  (:func:`~megalite.planner.fp8_time.fp8_gemm_flops_per_token`: the column- and
  row-parallel linears of the layers not kept in bf16 -- attention, dense MLP, shared
  expert; not the routed experts, the output layer or the attention core; fprop, dgrad
  and, unless ``--no-fp8-wgrad``, wgrad, a third of ``6 N`` each; fprop again under full
  recomputation) at ``fp8_flops x matmul_efficiency`` instead, or at ``fp32_flops`` those
  megalite emulates (the dequantised operands multiplied in fp32: every mxfp8 GEMM; the
  blockwise GEMMs without the GPU's block-scaled kernel, ``Cluster.fp8_block_kernel``,
  and its e5m2 gradient GEMMs under hybrid). Plus the quantisation passes at
  ``Cluster.memory_rate`` (``memory_bw x memory_efficiency``, as all the memory-bound
  work here): per micro-batch each fp8 linear's input and output gradient (an amax pass
  and a cast pass under tensorwise, the cast alone under delayed, a pass per GEMM under
  the block recipes), per step its weight (quantised and transposed once; under ZeRO-3
  after every gather).
  Plus the memory-bound work (norms, activation functions, softmax, copies): ``4 x`` the
  bytes the layers save for backward (:func:`layer_activation_elements`) at
  ``memory_rate``. Plus the fixed costs: ``layer_overhead_s`` per layer and micro-batch
  (and ``layer_forward_overhead_s`` again under full recomputation), and
  ``microbatch_overhead_s`` per micro-batch. Under ``--qk-clip`` (or
  ``--log-max-attention-logit``) the largest-logit pass (:mod:`megalite.planner.qk_clip`:
  ``2 nh d_qk s^2`` fp32 FLOPs per sequence and layer forward, at ``fp32_flops``, and its
  score traffic).
* **tp** -- per layer and micro-batch, forward and backward, two all-gathers and two
  reduce-scatters of the activations ``[s/cp, b, h]`` over tp under sequence parallelism
  (two all-reduces without: the same bytes), each moving ``(t-1)/t`` of them; full
  recomputation repeats the forward's. Per micro-batch and pass one more each around the
  embedding (first stage: its partial sums reduce-scattered) and the output layer (last:
  its input gathered), and the vocab-parallel cross entropy's two all-reduces of fp32
  ``[s/cp, b]`` (max; target logit and sum of exponentials). Per step, the sequence-
  parallel replicated parameters' gradients (norms, row-parallel biases, learned
  positions) summed over tp. Each collective also pays ``collective_overhead_s`` (0 on
  the GPU presets; on a CPU the cost of a blocking gloo call between compute, measured).
* **cp** -- ring attention: each layer's keys and values pass ``cp - 1`` hops forward and
  the same plus their gradients backward; under ``--qk-clip`` each layer forward's keys
  all-gathered once more.
* **ep** -- the MoE all-to-all: dispatch and combine, forward and backward, of the routed
  tokens ``top-k x tokens x h`` (the fraction ``(ep-1)/ep`` leaves the rank). Under
  ``--overlap-moe-expert-parallel-comm`` the paired backwards' share of it
  (:func:`megalite.planner.schedule.paired_backward_share`) runs under the other
  micro-batch's compute: exposed only where it is longer than that share of the compute.
  Under ``--moe-shared-expert-overlap`` the forward's dispatch (a quarter of the four
  exchanges) runs under the shared experts' forward (their matmuls at the compute rate):
  exposed only where longer.
* **pp** -- one activation per micro-batch and chunk boundary forward and its gradient
  backward, ``2 vpp m`` transfers of ``[s/cp, b, h]`` (``/tp`` under sp); per step the
  word embedding's gradient summed between the first and the last stage (tied
  embeddings).
* **dp** -- the gradient reduction over dp x cp (``2 (d-1)/d`` of the gradient bytes,
  all-reduce or reduce-scatter + parameter all-gather; under optim_grads and
  optim_grads_params the reduce-scatter runs once per micro-batch), exposed in full unless
  ``--overlap-grad-reduce`` (the reduction) and ``--overlap-param-gather`` (the gather)
  hide all but the last bucket (``OVERLAP_EXPOSED`` of it left); under
  ``--fp8-param-gather`` the fp8 linears' weights travel in the step's first gather as
  one byte per element (and not in ZeRO-3's later gathers of the step). Plus the step's two scalar
  all-reduces over the world (the loss and the gradient norm; latency only, a tree); under
  ``--qk-clip`` the layers' ``[nh/tp]`` maxima all-reduced over dp x cp and their largest
  over the world.
* **bubble** -- ``(pp - 1) / (vpp m)`` of the per-micro-batch path (compute, tp, cp, ep,
  pp transfers; not the once-per-step reductions); under ``--pipeline-schedule zb_h1``,
  ``zbv`` or ``dualpipev`` the schedule's own (:func:`megalite.planner.schedule.
  bubble_fraction`: ``(pp - 1) / (3 m)`` for ZB-H1, ``(pp - 1) / (6 m)`` for ZB-V and
  DualPipeV, once ``m >= pp``).
  Under optim_grads_params each unit's parameters are all-gathered before every forward
  and backward (``passes x m`` gathers of the stage's parameters), exposed.
* **optimizer** -- the step reads and writes the local optimizer state at ``memory_rate``;
  with ``--optimizer-cpu-offload`` the offloaded fraction's gradients go to the host and
  its parameters come back (8 bytes each at ``host_bw``) and the host steps Adam (36 bytes
  of traffic each at ``host_memory_bw``). Under ``--optimizer muon`` the matrices'
  element-wise passes at their own bytes per element, the busiest rank's Newton-Schulz
  FLOPs at the iteration's rate and its exchanges' bytes over tp and dp x cp
  (:mod:`megalite.planner.muon`).

The group a collective runs on is on NVLink or the network by its size and stride in
megalite's rank order (tp fastest, then cp, dp, pp; :meth:`Cluster.group_bw`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megalite.config.layout import ResolvedLayout, resolve_layout
from megalite.config.shapes import (
    active_layer_params,
    attention_head_dims,
    dense_mlp_params,
    fp8_layer,
    mla_up_proj_params,
    moe_layer_count,
    moe_mlp_params,
)
from megalite.planner import fp8_time, muon, qk_clip
from megalite.planner.cluster import Cluster
from megalite.planner.fp8_memory import fp8_weight_elements
from megalite.planner.memory import layer_activation_elements, stage_param_counts
from megalite.planner.schedule import bubble_fraction, paired_backward_share


MEMORY_PASSES = 4   # memory traffic per saved activation byte: write, read (forward),
                    # read, gradient write (backward)
OVERLAP_EXPOSED = 0.2   # share of an overlapped data-parallel collective left exposed (the
                        # last bucket's, which nothing follows)


@dataclass
class TimeEstimate:
    """Seconds per step by term, bytes each rank sends per parallelism, and MFU."""

    compute: float
    comm: dict           # parallelism -> seconds (exposed)
    comm_bytes: dict     # parallelism -> bytes sent per rank per step
    bubble: float
    optimizer: float
    step: float
    model_flops: float   # per step, whole model
    mfu: float
    calls: dict = None   # tp / pp / dp -> blocking collectives per step per rank counted
                         # above (tp: the layers', embedding's, output layer's, cross
                         # entropy's, replicated gradients'; pp: the embedding gradient's
                         # and the loss's; dp: the loss and gradient norm, under
                         # --qk-clip the maxima's two; not the bucketed gradient
                         # reduction or the stage-to-stage transfers)


@dataclass
class StepContext:
    """What every term of the time model reads: the config, its resolved layout, the
    cluster, and the per-rank quantities several terms share."""

    cfg: object
    lay: ResolvedLayout
    cluster: Cluster

    @property
    def tokens(self) -> int:
        """Tokens per rank per micro-batch."""
        return self.lay.tokens_per_microbatch

    @property
    def layers(self) -> int:
        """Transformer layers per pipeline stage."""
        return self.cfg.model.num_layers // self.lay.pp

    @property
    def act_bytes(self) -> int:
        """Bytes of one ``[s/cp, b, h]`` activation."""
        return self.tokens * self.cfg.model.hidden_size * self.lay.dtype_bytes

    @property
    def passes(self) -> int:
        """Passes over a layer per micro-batch: forward (again under full recompute),
        backward."""
        return 3 if self.cfg.model.recompute_granularity == "full" else 2


@dataclass
class Cost:
    """One parallelism's communication per step on one rank: ``path`` seconds on the
    per-micro-batch path (stretched by the pipeline bubble), ``once`` seconds once per
    step after the pipeline drains, ``sent`` bytes, ``calls`` blocking collectives."""

    path: float = 0.0
    once: float = 0.0
    sent: float = 0.0
    calls: int = 0


def _ring(bytes_: float, size: int, bw: float, latency: float, steps: int = 1) -> float:
    """Seconds of ``steps`` ring all-reduces of ``bytes_`` over ``size`` ranks."""
    if size <= 1:
        return 0.0
    return steps * (2.0 * (size - 1) / size * bytes_ / bw + 2 * (size - 1) * latency)


def compute_seconds(ctx: StepContext) -> float:
    """Matmuls (model FLOPs plus recomputation) at the cluster's rate, the memory-bound
    work, and the fixed per-layer and per-micro-batch costs (module docstring)."""
    m, p, lay, cluster = ctx.cfg.model, ctx.cfg.parallel, ctx.lay, ctx.cluster
    extra = 0.0
    all_tokens = lay.tokens_per_step
    if m.recompute_granularity == "full":
        extra = 2.0 * active_layer_params(m) * all_tokens
    elif m.recompute_granularity == "selective":   # the forward of what is recomputed
        d_qk, d_v = attention_head_dims(m)
        per_token = 0.0
        if m.recomputes("core_attn"):
            per_token += 2.0 * m.num_attention_heads * (d_qk + d_v) * m.seq_length
        if m.recomputes("mla_up_proj"):
            per_token += 2.0 * mla_up_proj_params(m)
        extra = m.num_layers * per_token * all_tokens
        if m.recomputes("mlp"):
            dense = m.num_layers - moe_layer_count(m)
            extra += 2.0 * dense * dense_mlp_params(m, 1) * all_tokens
        if m.recomputes("moe"):   # the routed top-k experts and the shared experts
            _, experts = moe_mlp_params(m, 1, 1, 1)
            shared = m.moe_shared_expert_intermediate_size
            per_token = experts // m.num_experts * m.moe_router_topk + (
                dense_mlp_params(m, 1, shared) if shared else 0)
            extra += 2.0 * moe_layer_count(m) * per_token * all_tokens
    # the fp8 GEMMs at the fp8 rate, or emulated in fp32 (megalite.planner.fp8_time)
    fp8, fp8_seconds = fp8_time.gemm_seconds(ctx)
    compute = (lay.model_flops_per_step + extra - fp8) / cluster.peak_flops \
        / lay.world_size / cluster.matmul_efficiency + fp8_seconds
    compute += max_logit_seconds(ctx) + fp8_time.quantize_seconds(ctx)
    # memory-bound work (norms, activations, softmax, residual adds, copies): each element
    # the layers keep for backward is written and read in forward and backward
    per_layer = [layer_activation_elements(m, p, lay.micro_batch_size, moe=moe,
                                           fp8=fp8_layer(m, layer))
                 for layer, moe in enumerate(m.moe_layer_pattern)]
    act_elems = sum(e["act"] * lay.dtype_bytes + e["fp32"] * 4 + e["fp8"]
                    for e in per_layer) / lay.pp
    memory_bound = MEMORY_PASSES * act_elems * lay.num_microbatches / cluster.memory_rate
    # fixed costs per layer and micro-batch (dispatch / launches), the rank's layers
    layer_fixed = cluster.layer_overhead_s + (cluster.layer_forward_overhead_s
                                              if m.recompute_granularity == "full" else 0.0)
    overhead = lay.num_microbatches * (ctx.layers * layer_fixed + cluster.microbatch_overhead_s)
    return compute + memory_bound + overhead


def max_logit_seconds(ctx: StepContext) -> float:
    """``--qk-clip`` / ``--log-max-attention-logit``: the largest-logit pass over the
    attention scores (:mod:`megalite.planner.qk_clip`), this rank's share: its fp32
    query-key products at ``fp32_flops x matmul_efficiency`` and its score traffic at
    memory bandwidth; 0 without."""
    m, lay, cluster = ctx.cfg.model, ctx.lay, ctx.cluster
    sequences = lay.global_batch_size / lay.world_size
    flops = qk_clip.flops_per_sequence(m) * sequences
    traffic = qk_clip.SCORE_PASSES * 4 * qk_clip.score_elements_per_sequence(m) * sequences
    rate = (cluster.fp32_flops or cluster.peak_flops) * cluster.matmul_efficiency
    return flops / rate + traffic / cluster.memory_rate


def tp_cost(ctx: StepContext) -> Cost:
    """Tensor (and sequence) parallel collectives: per layer and micro-batch, forward and
    backward, in all-gather/reduce-scatter units of ``[s/cp, b, h]`` (two of each under
    sp, or two all-reduces, each one of both); full recomputation re-runs a layer's forward
    only until backward has what it saved (torch's non-reentrant checkpoint stops early),
    so not its last reduction: 3 of the 4 (sp), 1 of the 2 all-reduces; per pass one more
    around the embedding (first stage) and the output layer (last stage); the column-
    parallel linears' gathers again in backward under sp; the vocab-parallel cross
    entropy; once per step the replicated gradients under sp."""
    m, p, lay, cluster = ctx.cfg.model, ctx.cfg.parallel, ctx.lay, ctx.cluster
    tp, num_micro, layers, tokens = lay.tp, lay.num_microbatches, ctx.layers, ctx.tokens
    if tp == 1:
        return Cost()
    h, lat, call = m.hidden_size, cluster.latency_s, cluster.collective_overhead_s
    tp_bw = cluster.group_bw(tp, 1)
    cost = Cost()
    edge = 2 if lay.pp == 1 else 1
    again = (3 if p.sequence_parallel else 2) if ctx.passes == 3 else 0
    hops = ((8 + again) * layers + 2 * edge) * num_micro
    hop = (tp - 1) / tp * ctx.act_bytes
    cost.calls = hops if p.sequence_parallel else hops // 2
    if p.sequence_parallel:
        # the column-parallel linears (qkv, fc1 of dense layers; the output layer on
        # the last stage) keep their [s/tp, b, h] input and gather it again in backward,
        # overlapped with the input gradient's product: exposed only where longer
        rate = cluster.peak_flops * cluster.matmul_efficiency
        gather = hop / tp_bw + (tp - 1) * lat
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
        fc1_out = (2 if m.swiglu else 1) * m.ffn_hidden_size
        dense = layers - (moe_layer_count(m) / lay.pp if m.num_experts is not None else 0)
        outs = [(qkv_out, layers), (fc1_out, dense), (lay.padded_vocab_size, 1)]
        regather = sum(n * (max(0.0, gather - 2 * tokens * h * out / tp / rate) + call)
                       for out, n in outs)
        cost.path += num_micro * regather
        cost.calls += num_micro * round(sum(n for _, n in outs))
        cost.sent += num_micro * sum(n for _, n in outs) * hop
    # vocab-parallel cross entropy, last stage, per micro-batch: the max and the
    # (target logit, sum of exponentials) all-reduces of fp32 [s/cp, b]
    ce = _ring(4 * tokens, tp, tp_bw, lat) + _ring(8 * tokens, tp, tp_bw, lat)
    cost.calls += 2 * num_micro
    cost.path += hops * (hop / tp_bw + (tp - 1) * lat) + num_micro * ce \
        + (hops if p.sequence_parallel else hops // 2) * call + 2 * num_micro * call
    cost.sent += hops * hop
    if p.sequence_parallel:   # the replicated (norm, bias, position) gradients, fp32
        norm = h * (1 if m.normalization == "RMSNorm" else 2)
        replicated = layers * (2 * norm + (2 * h if m.add_bias_linear else 0)) + norm + (
            m.max_position_embeddings * h if m.learned_positions else 0)
        cost.once = _ring(4 * replicated, tp, tp_bw, lat) + call
        cost.calls += 1
    return cost


def cp_cost(ctx: StepContext) -> Cost:
    """Ring attention: each layer's keys and values pass ``cp - 1`` hops forward and the
    same plus their gradients backward."""
    m, lay, cluster = ctx.cfg.model, ctx.lay, ctx.cluster
    cp = lay.cp
    if cp == 1:
        return Cost()
    kv = ctx.tokens * 2 * m.num_query_groups * m.kv_channels // lay.tp * lay.dtype_bytes
    sent = 3 * (cp - 1) * kv * ctx.layers * lay.num_microbatches
    cost = Cost(path=sent / cluster.group_bw(cp, lay.tp) + (cp - 1) * ctx.layers
                * lay.num_microbatches * (cluster.latency_s + cluster.collective_overhead_s),
                sent=sent)
    # --qk-clip: the keys all-gathered for the largest-logit pass, per layer forward
    gather = qk_clip.gather_bytes_per_microbatch(m, lay.tp, cp, lay.micro_batch_size,
                                                 lay.dtype_bytes)
    if gather:
        gathers = qk_clip.layer_passes(m) * ctx.layers * lay.num_microbatches
        cost.sent += gathers * gather
        cost.path += gathers * (gather / cluster.group_bw(cp, lay.tp) + (cp - 1)
                                * cluster.latency_s + cluster.collective_overhead_s)
    return cost


def ep_cost(ctx: StepContext) -> Cost:
    """The MoE all-to-all: dispatch and combine, forward and backward, of the routed
    tokens ``top-k x tokens x h`` (the fraction ``(ep-1)/ep`` leaves the rank). Under
    ``--overlap-moe-expert-parallel-comm`` the share ``f`` of backwards paired with a
    forward (:func:`~megalite.planner.schedule.paired_backward_share`) hides that share of
    the all-to-all behind the same share of the rank's compute: exposed ``(1 - f) a2a +
    f max(0, a2a - compute)``. Under ``--moe-shared-expert-overlap`` (refused with the
    former) the forward's dispatch, ``a2a / 4``, runs under the shared experts' forward
    (:func:`shared_expert_forward_seconds`): ``a2a - min(a2a / 4, shared)``."""
    m, p, lay = ctx.cfg.model, ctx.cfg.parallel, ctx.lay
    ep = lay.ep
    if ep == 1:
        return Cost()
    moe_layers = 0 if m.num_experts is None else moe_layer_count(m)
    a2a = 4 * (ep - 1) / ep * m.moe_router_topk * ctx.tokens // max(lay.tp, 1) \
        * m.hidden_size * lay.dtype_bytes * moe_layers / lay.pp * lay.num_microbatches
    seconds = a2a / ctx.cluster.group_bw(ep, lay.etp)
    if p.overlap_moe_expert_parallel_comm:
        f = paired_backward_share(lay.pp, lay.num_microbatches, lay.vpp,
                                  lay.pipeline_schedule)
        seconds = (1 - f) * seconds + f * max(0.0, seconds - compute_seconds(ctx))
    elif m.moe_shared_expert_overlap:
        seconds -= min(seconds / 4, shared_expert_forward_seconds(ctx))
    return Cost(path=seconds, sent=a2a)


def shared_expert_forward_seconds(ctx: StepContext) -> float:
    """The rank's share of the shared experts' forward matmuls in a step (``2 x`` their
    parameters per token, every MoE layer, the global batch over the world), at the
    cluster's matmul rate; 0 without shared experts."""
    m, lay, cluster = ctx.cfg.model, ctx.lay, ctx.cluster
    shared = m.moe_shared_expert_intermediate_size
    if not shared or m.num_experts is None:
        return 0.0
    flops = (2.0 * dense_mlp_params(m, 1, shared) * moe_layer_count(m)
             * lay.tokens_per_step)
    return flops / lay.world_size / cluster.peak_flops / cluster.matmul_efficiency


def pp_cost(ctx: StepContext) -> Cost:
    """Stage-to-stage transfers (``2 vpp m`` of ``[s/cp, b, h]``, ``/tp`` under sp); per
    step the tied word embedding's gradient between the first and last stage and the loss
    summed over the stages."""
    m, p, lay, cluster = ctx.cfg.model, ctx.cfg.parallel, ctx.lay, ctx.cluster
    pp, lat, call = lay.pp, cluster.latency_s, cluster.collective_overhead_s
    if pp == 1:
        return Cost()
    bw = cluster.group_bw(pp, lay.tp * lay.cp * lay.dp)
    sent = 2 * lay.vpp * lay.num_microbatches * ctx.act_bytes / lay.sp
    cost = Cost(path=sent / bw + 2 * lay.vpp * lay.num_microbatches * (lat + call),
                sent=sent)
    if not m.untie_embeddings_and_output_weights:
        emb = lay.padded_vocab_size // lay.tp * m.hidden_size * (
            2 if p.grad_reduce_in_bf16 else 4)
        cost.once = _ring(emb, 2, bw, lat) + call
        cost.sent += emb
        cost.calls = 1
    cost.once += 2 * math.ceil(math.log2(pp)) * lat + call   # the loss, a scalar
    cost.calls += 1
    return cost


def _rank_params(ctx: StepContext) -> int:
    """Parameter elements of the busiest pipeline stage's rank."""
    return max(sum(stage_param_counts(ctx.cfg.model, ctx.cfg.parallel, r))
               for r in range(ctx.lay.pp))


def _gathered_bytes(ctx: StepContext, gathers: int) -> float:
    """Bytes of the step's ``gathers`` all-gathers of the busiest stage rank's parameters
    under the distributed optimizer, in the training dtype; under ``--fp8-param-gather``
    each (ZeRO-3's too, before every forward and backward: its freed units keep no fp8
    weights) carries the fp8 linears' weights as one byte per element
    (:mod:`megalite.optim.fp8_param_gather`)."""
    m, p, lay = ctx.cfg.model, ctx.cfg.parallel, ctx.lay
    out = 0.0
    for r in range(lay.pp):
        total = sum(stage_param_counts(m, p, r)) * lay.dtype_bytes
        fp8 = fp8_weight_elements(m, p, r) if m.fp8_param_gather else 0
        out = max(out, gathers * (total - fp8 * (lay.dtype_bytes - 1)))
    return out


def dp_cost(ctx: StepContext) -> Cost:
    """The gradient reduction over dp x cp (all-reduce, or reduce-scatter + parameter
    all-gather under the distributed optimizer; ZeRO-2/3 reduce-scatter once per
    micro-batch, and ZeRO-3 gathers each unit before every forward and backward), exposed
    in full unless --overlap-grad-reduce / --overlap-param-gather hide all but the last
    bucket; plus the loss and gradient norm, two scalar all-reduces over the world."""
    p, lay, cluster = ctx.cfg.parallel, ctx.lay, ctx.cluster
    lat = cluster.latency_s
    local = _rank_params(ctx)
    grad_bytes = local * (2 if p.grad_reduce_in_bf16 else 4)
    d = lay.dp * lay.cp
    bw = cluster.group_bw(d, lay.tp)
    hidden = OVERLAP_EXPOSED   # the exposed share of an overlapped reduction or gather
    if not p.use_distributed_optimizer:   # one all-reduce of the gradients
        dp_time = _ring(grad_bytes, d, bw, lat) * (hidden if p.overlap_grad_reduce else 1)
    else:  # reduce-scatter the gradients, all-gather the parameters (a ring each: half
        # an all-reduce's traffic), each overlapped by its own flag
        gathers = 1
        if lay.strategy == "optim_grads_params":   # each unit before forward and backward
            gathers = ctx.passes * lay.num_microbatches
        if lay.strategy in ("optim_grads", "optim_grads_params"):   # once per micro-batch
            grad_bytes *= lay.num_microbatches
        dp_time = (_ring(grad_bytes / 2, d, bw, lat) * (hidden if p.overlap_grad_reduce
                                                         else 1)
                   + _ring(_gathered_bytes(ctx, gathers) / 2, d, bw, lat)
                   * (hidden if p.overlap_param_gather else 1))
    if not p.use_distributed_optimizer:
        sent = 2 * (d - 1) / d * grad_bytes
    else:   # the gradients' reduce-scatter, the parameters' all-gathers
        sent = (d - 1) / d * (grad_bytes + _gathered_bytes(ctx, gathers))
    cost = Cost(sent=sent if d > 1 else 0.0)
    scalars = 0.0
    if lay.world_size > 1:   # the loss and the gradient norm: two scalar all-reduces
        scalars = 2 * (2 * math.ceil(math.log2(lay.world_size)) * lat
                       + cluster.collective_overhead_s)
        cost.calls = 2
    if qk_clip.enabled(ctx.cfg.model):   # the layers' maxima over dp x cp, the top one
        m = ctx.cfg.model                  # over the world
        maxima = 4 * ctx.layers * m.num_attention_heads // lay.tp
        scalars += _ring(maxima, d, bw, lat) + cluster.collective_overhead_s * (d > 1)
        if lay.world_size > 1:
            scalars += 2 * math.ceil(math.log2(lay.world_size)) * lat \
                + cluster.collective_overhead_s
            cost.calls += 1 + (d > 1)
    cost.once = dp_time + scalars
    return cost


def optimizer_seconds(ctx: StepContext) -> float:
    """The step reads and writes the local optimizer state at memory bandwidth; with
    --optimizer-cpu-offload the offloaded fraction's gradients go to the host and its
    parameters come back and the host steps Adam; Muon adds its Newton-Schulz iterations
    and their exchanges (module docstring)."""
    o, p, lay, cluster = ctx.cfg.optim, ctx.cfg.parallel, ctx.lay, ctx.cluster
    local = _rank_params(ctx)
    shard = lay.dp * lay.cp if p.use_distributed_optimizer else 1
    offload = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    per_element = 16 + 2 * lay.dtype_bytes   # every parameter's bytes of traffic
    seconds = (1 - offload) * local * per_element / shard / cluster.memory_rate
    if offload:  # gradients to the host, parameters back (fp32), Adam on the host
        moved = offload * local / shard
        seconds += moved * 8 / cluster.host_bw + moved * 36 / cluster.host_memory_bw
    if o.optimizer == "muon":   # Newton-Schulz and its exchanges (megalite.planner.muon)
        extra = muon.elementwise_bytes(o.muon_nesterov, lay.dtype_bytes) - per_element
        seconds += (1 - offload) * muon.elementwise_elements(ctx.cfg, lay) * extra \
            / cluster.memory_rate
        seconds += muon.step_flops(ctx.cfg, lay) / muon.iteration_rate(
            o.muon_fp32_matmul_prec, cluster)
        tp_bytes, dp_bytes = muon.step_bytes(ctx.cfg, lay)
        seconds += tp_bytes / cluster.group_bw(lay.tp, 1) \
            + dp_bytes / cluster.group_bw(lay.dp * lay.cp, lay.tp)
    return seconds


# one cost function per parallelism, in the order their path terms are added
COSTS: dict[str, Callable[[StepContext], Cost]] = {
    "tp": tp_cost, "cp": cp_cost, "ep": ep_cost, "pp": pp_cost, "dp": dp_cost}


def estimate_time(cfg, world_size: int, cluster: Cluster) -> TimeEstimate:
    """Estimated step time of ``cfg`` (validated for ``world_size``; its vocabulary
    known) on ``cluster``: compute, each parallelism's :data:`COSTS`, the bubble over the
    per-micro-batch path, the once-per-step terms, the optimizer."""
    lay = resolve_layout(cfg, world_size)
    ctx = StepContext(cfg, lay, cluster)
    compute = compute_seconds(ctx)
    costs = {name: cost(ctx) for name, cost in COSTS.items()}
    path = compute
    for c in costs.values():
        path += c.path
    bubble = bubble_fraction(lay.pp, lay.num_microbatches, lay.vpp,
                             lay.pipeline_schedule) * path \
        if lay.pp > 1 else 0.0
    optimizer = optimizer_seconds(ctx)
    step = path + bubble
    for c in costs.values():
        step += c.once
    step += optimizer
    flops = lay.model_flops_per_step
    return TimeEstimate(
        compute=compute, comm={k: c.path + c.once for k, c in costs.items()},
        comm_bytes={k: c.sent for k, c in costs.items()}, bubble=bubble,
        optimizer=optimizer, step=step, model_flops=flops,
        mfu=flops / (step * world_size * cluster.peak_flops),
        calls={k: costs[k].calls for k in ("tp", "pp", "dp")})
