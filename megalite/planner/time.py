"""Step time of a layout: compute, communication per parallelism, pipeline bubble, MFU.

Per step (one global batch), for one rank (all ranks do the same work, up to the
pipeline's first and last stage):

* **compute** -- the model FLOPs of the step (:func:`step_model_flops`:
  ``megalite.training.throughput.flops_per_token`` of the active parameters: top-k
  experts, not all) divided over the ``world`` ranks, plus what recomputation adds
  (full: the forward again, 2N per token of the layers; selective: the attention core's
  forward, 4 L h s per token), at ``peak_flops x matmul_efficiency``.
  Plus the memory-bound work (norms, activation functions, softmax, copies): ``4 x`` the
  bytes the layers save for backward (:func:`layer_activation_elements`) at
  ``memory_bw``. Plus the fixed costs: ``layer_overhead_s`` per layer and micro-batch
  (and ``layer_forward_overhead_s`` again under full recomputation), and
  ``microbatch_overhead_s`` per micro-batch.
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
  the same plus their gradients backward.
* **ep** -- the MoE all-to-all: dispatch and combine, forward and backward, of the routed
  tokens ``top-k x tokens x h`` (the fraction ``(ep-1)/ep`` leaves the rank).
* **pp** -- one activation per micro-batch and chunk boundary forward and its gradient
  backward, ``2 vpp m`` transfers of ``[s/cp, b, h]`` (``/tp`` under sp); per step the
  word embedding's gradient summed between the first and the last stage (tied
  embeddings).
* **dp** -- the gradient reduction over dp x cp (``2 (d-1)/d`` of the gradient bytes,
  all-reduce or reduce-scatter + parameter all-gather), exposed in full unless
  ``--overlap-grad-reduce`` hides all but the last bucket. Plus the step's two scalar
  all-reduces over the world (the loss and the gradient norm; latency only, a tree).
* **bubble** -- ``(pp - 1) / (vpp m)`` of the per-micro-batch path (compute, tp, cp, ep,
  pp transfers; not the once-per-step reductions).
  Under optim_grads_params each unit's parameters are all-gathered before every forward
  and backward (``passes x m`` gathers of the stage's parameters), exposed.
* **optimizer** -- the step reads and writes the local optimizer state at memory bandwidth;
  with ``--optimizer-cpu-offload`` the offloaded fraction's gradients go to the host and
  its parameters come back (8 bytes each at ``host_bw``) and the host steps Adam (36 bytes
  of traffic each at ``host_memory_bw``).

The group a collective runs on is on NVLink or the network by its size and stride in
megalite's rank order (tp fastest, then cp, dp, pp; :meth:`Cluster.group_bw`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megalite.planner.cluster import Cluster
from megalite.planner.memory import dense_layer_params, dense_mlp_params, moe_mlp_params
from megalite.planner.schedule import bubble_fraction
from megalite.training.throughput import flops_per_token


MEMORY_PASSES = 4   # memory traffic per saved activation byte: write, read (forward),
                    # read, gradient write (backward)


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
                         # and the loss's;
                         # dp: the loss and gradient norm; not the bucketed gradient
                         # reduction or the stage-to-stage transfers)


def active_layer_params(m) -> int:
    """Transformer-layer parameters a token passes through (tp 1): attention, norms and
    dense MLPs, the router and ``top-k`` experts of MoE layers, the final norm."""
    n = 0
    for layer in range(m.num_layers):
        n += dense_layer_params(m, 1)
        if m.num_experts is not None and layer % m.moe_layer_freq == 0:
            dense, experts = moe_mlp_params(m, 1, 1, 1)
            n += dense + experts // m.num_experts * m.moe_router_topk
        else:
            n += dense_mlp_params(m, 1)
    return n + m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)


def moe_layer_count(m) -> int:
    """MoE layers of the model (every ``moe_layer_freq``-th from the first)."""
    return len(range(0, m.num_layers, m.moe_layer_freq))


def step_model_flops(cfg) -> float:
    """Model FLOPs of one step (global batch), as megalite's MFU counts them."""
    m, t = cfg.model, cfg.train
    per_token = flops_per_token(active_layer_params(m), m.num_layers, m.hidden_size,
                                m.seq_length, m.padded_vocab_size(1))
    return per_token * t.global_batch_size * m.seq_length


def _ring(bytes_: float, size: int, bw: float, latency: float, steps: int = 1) -> float:
    """Seconds of ``steps`` ring all-reduces of ``bytes_`` over ``size`` ranks."""
    if size <= 1:
        return 0.0
    return steps * (2.0 * (size - 1) / size * bytes_ / bw + 2 * (size - 1) * latency)


def estimate_time(cfg, world_size: int, cluster: Cluster) -> TimeEstimate:
    """Estimated step time of ``cfg`` (validated for ``world_size``) on ``cluster``."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, \
        p.context_parallel_size
    dp = world_size // (tp * pp * cp)
    ep = p.expert_model_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size or 1
    eb = 2 if (m.bf16 or m.fp16) else 4
    mb = t.micro_batch_size
    num_micro = t.global_batch_size // (mb * dp)
    layers = m.num_layers // pp
    tokens = m.seq_length // cp * mb                  # per rank per micro-batch
    h, lat = m.hidden_size, cluster.latency_s

    flops = step_model_flops(cfg)
    extra = 0.0
    layer_n = active_layer_params(m)
    all_tokens = t.global_batch_size * m.seq_length
    if m.recompute_granularity == "full":
        extra = 2.0 * layer_n * all_tokens
    elif m.recompute_granularity == "selective":
        extra = 4.0 * m.num_layers * h * m.seq_length * all_tokens
    compute = (flops + extra) / world_size / (cluster.peak_flops * cluster.matmul_efficiency)
    # memory-bound work (norms, activations, softmax, residual adds, copies): each element
    # the layers keep for backward is written and read in forward and backward
    from megalite.planner.memory import layer_activation_elements

    moe_every = m.moe_layer_freq if m.num_experts is not None else 0
    per_layer = [layer_activation_elements(m, p, mb, moe=bool(moe_every) and i % moe_every == 0)
                 for i in range(m.num_layers)]
    act_elems = sum(e["act"] * eb + e["fp32"] * 4 for e in per_layer) / pp
    memory_bound = MEMORY_PASSES * act_elems * num_micro / cluster.memory_bw
    # fixed costs per layer and micro-batch (dispatch / launches), the rank's layers
    layer_fixed = cluster.layer_overhead_s + (cluster.layer_forward_overhead_s
                                              if m.recompute_granularity == "full" else 0.0)
    overhead = num_micro * (layers * layer_fixed + cluster.microbatch_overhead_s)
    compute += memory_bound + overhead

    comm, sent = {}, {}
    act_bytes = tokens * h * eb
    passes = 3 if m.recompute_granularity == "full" else 2   # forward (again), backward
    tp_bw, call = cluster.group_bw(tp, 1), cluster.collective_overhead_s
    calls = {"tp": 0, "pp": 0, "dp": 0}   # blocking collectives per step (rank), by group
    step_comm = {"tp": 0.0, "pp": 0.0, "dp": 0.0}   # once per step, after the pipeline
    comm["tp"] = sent["tp"] = 0.0
    if tp > 1:
        # in all-gather/reduce-scatter units of [s/cp, b, h] per micro-batch: per layer,
        # forward and backward, two of each (sp), or two all-reduces (each one of both);
        # full recomputation re-runs a layer's forward only until backward has what it
        # saved (torch's non-reentrant checkpoint stops early), so not its last reduction:
        # 3 of the 4 (sp), 1 of the 2 all-reduces; per pass one more around the embedding
        # (first stage) and the output layer (last stage)
        edge = 2 if pp == 1 else 1
        again = (3 if p.sequence_parallel else 2) if passes == 3 else 0
        hops = ((8 + again) * layers + 2 * edge) * num_micro
        hop = (tp - 1) / tp * act_bytes
        calls["tp"] = hops if p.sequence_parallel else hops // 2
        if p.sequence_parallel:
            # the column-parallel linears (qkv, fc1 of dense layers; the output layer on
            # the last stage) keep their [s/tp, b, h] input and gather it again in backward,
            # overlapped with the input gradient's product: exposed only where longer
            rate = cluster.peak_flops * cluster.matmul_efficiency
            gather = hop / tp_bw + (tp - 1) * lat
            qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
            fc1_out = (2 if m.swiglu else 1) * m.ffn_hidden_size
            dense = layers - (moe_layer_count(m) / pp if m.num_experts is not None else 0)
            outs = [(qkv_out, layers), (fc1_out, dense), (m.padded_vocab_size(tp), 1)]
            regather = sum(n * (max(0.0, gather - 2 * tokens * h * out / tp / rate) + call)
                           for out, n in outs)
            comm["tp"] += num_micro * regather
            calls["tp"] += num_micro * round(sum(n for _, n in outs))
            sent["tp"] += num_micro * sum(n for _, n in outs) * hop
        # vocab-parallel cross entropy, last stage, per micro-batch: the max and the
        # (target logit, sum of exponentials) all-reduces of fp32 [s/cp, b]
        ce = _ring(4 * tokens, tp, tp_bw, lat) + _ring(8 * tokens, tp, tp_bw, lat)
        calls["tp"] += 2 * num_micro
        comm["tp"] += hops * (hop / tp_bw + (tp - 1) * lat) + num_micro * ce \
            + (hops if p.sequence_parallel else hops // 2) * call + 2 * num_micro * call
        sent["tp"] += hops * hop
        if p.sequence_parallel:   # the replicated (norm, bias, position) gradients, fp32
            norm = h * (1 if m.normalization == "RMSNorm" else 2)
            replicated = layers * (2 * norm + (2 * h if m.add_bias_linear else 0)) + norm + (
                m.max_position_embeddings * h if m.learned_positions else 0)
            step_comm["tp"] = _ring(4 * replicated, tp, tp_bw, lat) + call
            calls["tp"] += 1
    kv = tokens * 2 * m.num_query_groups * m.kv_channels // tp * eb
    cp_bytes = 3 * (cp - 1) * kv * layers * num_micro if cp > 1 else 0.0
    comm["cp"] = cp_bytes / cluster.group_bw(cp, tp) + (cp - 1) * layers * num_micro * (
        lat + call) if cp > 1 else 0.0
    sent["cp"] = cp_bytes
    moe_layers = 0 if m.num_experts is None else moe_layer_count(m)
    a2a = 4 * (ep - 1) / ep * m.moe_router_topk * tokens // max(tp, 1) * h * eb \
        * moe_layers / pp * num_micro if ep > 1 else 0.0
    comm["ep"] = a2a / cluster.group_bw(ep, p.expert_tensor_parallel_size) if ep > 1 else 0.0
    sent["ep"] = a2a
    sp = tp if p.sequence_parallel else 1
    pp_bytes = 2 * vpp * num_micro * act_bytes / sp if pp > 1 else 0.0
    comm["pp"] = (pp_bytes / cluster.group_bw(pp, tp * cp * dp)
                  + 2 * vpp * num_micro * (lat + call) if pp > 1 else 0.0)
    sent["pp"] = pp_bytes
    if pp > 1 and not m.untie_embeddings_and_output_weights:
        # the word embedding's gradient summed between the first and the last stage
        emb = m.padded_vocab_size(tp) // tp * h * (2 if p.grad_reduce_in_bf16 else 4)
        step_comm["pp"] = _ring(emb, 2, cluster.group_bw(pp, tp * cp * dp), lat) + call
        sent["pp"] += emb
        calls["pp"] = 1
    if pp > 1:   # the loss, summed over the stages (a scalar)
        step_comm["pp"] += 2 * math.ceil(math.log2(pp)) * lat + call
        calls["pp"] += 1
    from megalite.planner.memory import stage_param_counts

    local = max(sum(stage_param_counts(m, p, r)) for r in range(pp))
    grad_bytes = local * (2 if p.grad_reduce_in_bf16 else 4)
    d = dp * cp
    dp_time = _ring(grad_bytes, d, cluster.group_bw(d, tp), lat)
    strategy = p.data_parallel_sharding_strategy
    if p.use_distributed_optimizer:  # reduce-scatter grads + all-gather params
        gathers = 1
        if strategy == "optim_grads_params":   # each unit before forward and backward
            gathers = passes * num_micro
        dp_time = _ring((grad_bytes + gathers * local * eb) / 2, d, cluster.group_bw(d, tp),
                        lat)
    if p.overlap_grad_reduce:
        dp_time *= 0.2
    comm["dp"] = dp_time
    sent["dp"] = 2 * (d - 1) / d * grad_bytes if d > 1 else 0.0
    if world_size > 1:   # the loss and the gradient norm: two scalar all-reduces (a tree)
        step_comm["dp"] = 2 * (2 * math.ceil(math.log2(world_size)) * lat + call)
        calls["dp"] = 2

    path = compute + comm["tp"] + comm["cp"] + comm["ep"] + comm["pp"]
    bubble = bubble_fraction(pp, num_micro, vpp) * path if pp > 1 else 0.0
    for k, v in step_comm.items():
        comm[k] += v
    shard = d if p.use_distributed_optimizer else 1
    offload = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    optimizer = (1 - offload) * local * (16 + 2 * eb) / shard / cluster.memory_bw
    if offload:  # gradients to the host, parameters back (fp32), Adam on the host
        moved = offload * local / shard
        optimizer += moved * 8 / cluster.host_bw + moved * 36 / cluster.host_memory_bw
    step = path + bubble + comm["dp"] + step_comm["tp"] + step_comm["pp"] + optimizer
    mfu = flops / (step * world_size * cluster.peak_flops)
    return TimeEstimate(compute=compute, comm=comm, comm_bytes=sent, bubble=bubble,
                        optimizer=optimizer, step=step, model_flops=flops, mfu=mfu,
                        calls=calls)
