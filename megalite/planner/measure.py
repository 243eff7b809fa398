"""Measured peak memory of a real run on CPU, the same way for every layout.

The allocation tracker is the PyTorch profiler's memory view: with ``profile_memory`` it
records every allocation and free of the CPU allocator (bytes, time). The peak of a
stretch of code is the highest running sum of those events, added to the bytes already
live when the stretch starts (``baseline``, counted by the caller from the storages it
knows of: parameters, gradient buffers, optimizer state). Every tensor counts, views once
(they allocate nothing), whoever allocates it: activations saved for backward, transient
logits, communication buffers, the optimizer's temporaries.

The profiler records the allocator's events of the threads it profiles only: a tensor
whose last reference dies on another thread is freed unseen. gloo's worker threads do
this to collective buffers (the input copy of a reduce-scatter, an all-gather's output):
the work object a worker runs keeps its tensors until the worker drops it, which is
often after the training thread has dropped its own references. Counted as never freed,
those buffers would pile up over a step (0.5-1 MiB in a tiny tp2 run, varying from run to
run with the threads' timing). The running sum therefore follows each block by its
address: an allocation at the address of a block still counted as live means that block
was freed unseen, before it, and it is taken off the sum there (:func:`live_bytes`; so
is a block that a new allocation overlaps).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def peak_allocated(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under the profiler; (its result, peak bytes allocated above the bytes
    live at the start). Frees of memory allocated before the start count as negative, so
    the figure is the peak of the change in live bytes (never below 0)."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size, f.ptr))
    return result, max([0, *live_bytes(events)])


def live_bytes(events) -> list[int]:
    """The running sum of bytes allocated after each of ``events`` (``(time ns, bytes,
    address)``: bytes > 0 an allocation, < 0 a free), in time order (a free before an
    allocation of the same instant). A block allocated over the bytes of a block still
    counted as live (at its address or inside it, or spanning it) replaces it: that one
    was freed on a thread the profiler does not record (gloo's workers), so its bytes come
    off the sum there."""
    starts: list[int] = []          # addresses of the blocks counted as live, sorted
    sizes: dict[int, int] = {}
    live, out = 0, []
    for _, nbytes, ptr in sorted(events, key=lambda e: (e[0], e[1])):
        if nbytes > 0:
            i = bisect.bisect_left(starts, ptr + nbytes)
            while i > 0 and starts[i - 1] + sizes[starts[i - 1]] > ptr:   # overlaps
                live -= sizes.pop(starts.pop(i - 1))
                i -= 1
            bisect.insort(starts, ptr)
            sizes[ptr] = nbytes
        elif ptr in sizes:
            del sizes[ptr]
            starts.pop(bisect.bisect_left(starts, ptr))
        live += nbytes
        out.append(live)
    return out


def measure_training_peak(cfg, iterations: int = 1) -> dict:
    """Build ``cfg`` in this process's world (gloo ranks already initialized) as
    ``pretrain_gpt.py`` does, train ``iterations`` steps, and return this rank's
    ``{"peak": bytes, "baseline": bytes, "params": elements, "pp_rank": int}``: ``peak`` is
    the highest number of bytes live during training (baseline + profiler peak), where
    ``baseline`` are the parameters, gradient buffers and optimizer state present after
    the build (:func:`megalite.optim.memory.rank_memory`)."""
    import copy

    from megalite.optim.memory import rank_memory
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from megalite.training.loop import train

    cfg = copy.deepcopy(cfg)
    cfg.train.train_iters = iterations
    ps = ParallelState.build(cfg.parallel)
    c = build_components(cfg, ps, peak_probe_seconds=0.0)
    try:
        mem = rank_memory(c.model, c.grads, c.optimizer)
        baseline = mem.params + mem.grads + mem.optimizer
        _, peak = peak_allocated(lambda: train(c))
        out = {"peak": baseline + peak, "baseline": baseline, "params": mem.num_params,
               "param_bytes": mem.params, "grad_bytes": mem.grads,
               "optim_bytes_built": mem.optimizer, "pp_rank": ps.pp.rank,
               "tp_rank": ps.tp.rank}
        after = rank_memory(c.model, c.grads, c.optimizer)
        out["optim_bytes"] = after.optimizer
    finally:
        c.close()
        ps.destroy()
    return out


# -- the machine as a 'cluster': probes the time model is checked with -------------------
# Each probe is short (tens of ms) so that a check can interleave it with the step timings
# it explains and take medians; run on every rank of a world at once, so a rank's figure is
# its share of the machine (a world of 4 ranks on 2 cores: half a core each).

def layout_gemms(cfg) -> list[tuple[int, int, int]]:
    """``(tokens, in, out)`` of the linear layers one micro-batch runs on one rank of
    ``cfg`` (per transformer layer: qkv, attention projection, fc1, fc2,
    :func:`megalite.config.shapes.layer_gemms`; then the output layer): the shapes whose
    FLOP/s the time model's compute term needs."""
    from megalite.config.shapes import layer_gemms

    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    tokens = cfg.train.micro_batch_size * m.seq_length // p.context_parallel_size
    return [*layer_gemms(m, tokens, tp), (tokens, m.hidden_size, m.padded_vocab_size(tp) // tp)]


def matmul_rate(shapes: list[tuple[int, int, int]], seconds: float = 0.05) -> float:
    """fp32 FLOP/s of the forward and both backward products of the linear layers
    ``shapes`` (``x [n, k] @ w [k, o]``, ``g [n, o] @ w.T``, ``x.T @ g``), each shape once
    per pass, passes repeated for about ``seconds``."""
    import time

    import torch

    mats = [(torch.randn(n, k), torch.randn(k, o), torch.randn(n, o)) for n, k, o in shapes]
    flops = sum(3 * 2.0 * n * k * o for n, k, o in shapes)
    count, start = 0, time.perf_counter()
    while True:
        for x, w, g in mats:
            x @ w
            g @ w.t()
            x.t() @ g
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return flops * count / elapsed


def memory_bandwidth(elements: int = 1 << 21, repeats: int = 4) -> float:
    """Bytes/s of an out-of-cache elementwise add (two reads, one write), the best of
    ``repeats``."""
    import time

    import torch

    a, b = torch.randn(elements), torch.randn(elements)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(a, b, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * elements * 4 / best


def collective_speed(nbytes: int = 1 << 20, repeats: int = 5) -> tuple[float, float]:
    """(latency s per ring hop, bandwidth bytes/s) of the world's all-gather and
    reduce-scatter (the pair tensor and sequence parallelism run per linear layer, and
    what the distributed optimizer runs per bucket), from the median times of the pair on
    a gathered tensor of 4 bytes per rank and of ``nbytes``: ``t(b) = (n-1) (latency +
    b / (n bw))`` per collective. Collective: every rank calls it. (0, inf) on one rank.
    On a loaded machine the latency is mostly the wake-up of a rank that waited."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    n = dist.get_world_size() if dist.is_initialized() else 1
    if n == 1:
        return 0.0, float("inf")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def pair(elements: int) -> float:
        whole, part = torch.zeros(elements * n), torch.zeros(elements)
        runs = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            gather(whole, part)
            scatter(part, whole)
            if i:
                runs.append((time.perf_counter() - start) / 2)
        return statistics.median(runs)

    t_small, t_large = pair(1), pair(max(1, nbytes // (4 * n)))
    latency = t_small / (n - 1)
    bw = (n - 1) / n * nbytes / max(t_large - t_small, 1e-6)
    return latency, bw


def tp_collective_cost(cfg, group, rounds: int = 7) -> tuple[float, float]:
    """(seconds per collective, seconds per GEMM pass) of tensor parallelism as a layer
    issues them: per round, one transformer layer's forward on this rank's shapes
    (:func:`layout_gemms`: ``[s b, h] @ [h, qkv/t]``, the attention projection, fc1, fc2)
    with the sequence-parallel all-gather of ``[s/t, b, h]`` before each column-parallel
    pair and the reduce-scatter of ``[s, b, h]`` after each row-parallel GEMM, on
    ``group`` (through the layers' own autograd mappings, so their copies and dispatch
    count), timed against the same GEMMs without them, alternating; the median of the
    paired differences. That difference per collective is what one costs between compute:
    its latency and bytes
    plus, on a CPU, waking gloo's threads on cores the ranks compute on and the ranks'
    arrival skew, which a back-to-back probe (:func:`collective_speed`) does not see.
    Collective on ``group`` (every member calls it); (0, GEMM time) alone."""
    import statistics
    import time

    import torch

    from megalite.parallel import mappings

    m, t = cfg.model, group.size
    tokens, h = cfg.train.micro_batch_size * m.seq_length // cfg.parallel.context_parallel_size, \
        m.hidden_size
    qkv, proj, fc1, fc2, _ = layout_gemms(cfg)
    weights = [torch.randn(k, o) for _, k, o in (qkv, proj, fc1, fc2)]
    inner = [torch.randn(tokens, proj[1]), torch.randn(tokens, fc2[1])]
    part = torch.randn(max(1, tokens // max(t, 1)), h)
    layers = 1

    def run(with_comm: bool) -> float:
        start = time.perf_counter()
        for _ in range(layers):
            for pair in range(2):     # attention: qkv, proj; MLP: fc1, fc2
                x = mappings.gather_from_sequence_parallel_region(part, group) \
                    if with_comm else part.repeat(t, 1)
                x @ weights[2 * pair]
                y = inner[pair] @ weights[2 * pair + 1]
                if with_comm:
                    mappings.reduce_scatter_to_sequence_parallel_region(y, group)
        return time.perf_counter() - start

    run(True)
    extra, gemm = [], []
    for _ in range(rounds):   # paired, so that a change in the machine's load cancels
        with_comm = run(True)
        gemm.append(run(False))
        extra.append(with_comm - gemm[-1])
    per_call = statistics.median(extra) / (4 * layers)
    return (max(0.0, per_call) if t > 1 else 0.0), statistics.median(gemm) / (4 * layers)


def GPTModel(*args, **kwargs):   # noqa: N802 (imported late: megalite.models is heavy)
    from megalite.models.gpt import GPTModel as _GPTModel

    return _GPTModel(*args, **kwargs)


class OverheadProbe:
    """Fixed costs of megalite's own layers at a size where their math is negligible
    (hidden 32, 16 tokens): forward + backward of GPT models of 1 and 3 layers, so that
    ``layer`` is the seconds one more layer adds to a micro-batch (forward and backward)
    and ``microbatch`` what remains (embedding, output layer, loss), and ``layer_forward``
    the forward's share of ``layer`` (what full recomputation adds). Built on this
    process's world with tp 1 (no collective runs in the probe)."""

    def __init__(self, world_size: int):
        import torch

        from megalite.arguments import parse_args
        from megalite.parallel.state import ParallelState

        self.models = []
        for layers in (1, 3):
            cfg = parse_args(["--num-layers", str(layers), "--hidden-size", "32",
                              "--num-attention-heads", "2", "--seq-length", "16",
                              "--max-position-embeddings", "16", "--vocab-size", "64",
                              "--micro-batch-size", "1", "--global-batch-size",
                              str(world_size), "--train-iters", "1", "--mock-data",
                              "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
                              "--attention-dropout", "0", "--attention-backend", "sdpa"]
                             ).validate(world_size)
            if not self.models:
                self.ps = ParallelState.build(cfg.parallel)
            self.models.append(GPTModel(cfg.model, self.ps, seed=1))
        self.ids = torch.randint(0, 64, (1, 16))
        self._rate_models = {}

    def _time(self, model, backward: bool, repeats: int, ids=None) -> float:
        import statistics
        import time

        ids = self.ids if ids is None else ids
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            loss = model(ids, labels=ids).float().mean()
            if backward:
                loss.backward()
            runs.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        return statistics.median(runs)

    def measure(self, repeats: int = 5) -> dict:
        """``{"layer": s, "layer_forward": s, "microbatch": s}`` (medians of ``repeats``)."""
        one, three = (self._time(m, True, repeats) for m in self.models)
        f_one, f_three = (self._time(m, False, repeats) for m in self.models)
        layer = max(0.0, (three - one) / 2)
        return {"layer": layer, "layer_forward": min(layer, max(0.0, (f_three - f_one) / 2)),
                "microbatch": max(0.0, one - layer)}

    def layer_rate(self, cfg, overhead_s: float, repeats: int = 3) -> float:
        """Effective FLOP/s of one transformer layer of ``cfg`` as one rank runs it: GPT
        models of 1 and 3 layers with this rank's share of the layer (heads, ffn and
        sequence divided by tp and cp; tp 1, so no collective) timed forward and backward
        on one micro-batch; the planner's FLOPs of the two extra layers over their time
        less ``overhead_s`` (the fixed cost of a layer). What a layer runs besides its
        GEMMs (attention core, norms, activation, copies) is in the rate."""
        import copy

        import torch

        from megalite.planner.memory import dense_layer_params, dense_mlp_params

        m, p = cfg.model, cfg.parallel
        tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
        key = (m.hidden_size, m.num_attention_heads // tp, m.ffn_hidden_size // tp,
               m.seq_length // cp, cfg.train.micro_batch_size)
        if key not in self._rate_models:
            models = []
            for layers in (1, 3):
                pm = copy.deepcopy(m)
                pm.num_layers, pm.num_attention_heads = layers, m.num_attention_heads // tp
                pm.num_query_groups = max(1, m.num_query_groups // tp)
                pm.kv_channels, pm.ffn_hidden_size = m.kv_channels, m.ffn_hidden_size // tp
                pm.seq_length = m.seq_length // cp
                pm.vocab_size = 64
                pm.recompute_granularity = pm.recompute_method = None
                pm.recompute_num_layers = None
                models.append(GPTModel(pm, self.ps, seed=1))
            ids = torch.randint(0, 64, (key[4], key[3]))
            self._rate_models[key] = (models, ids, pm)
        models, ids, pm = self._rate_models[key]
        one, three = (self._time(mod, True, repeats, ids) for mod in models)
        tokens = ids.numel()
        flops = (6.0 * (dense_layer_params(pm, 1) + dense_mlp_params(pm, 1)) * tokens
                 + 12.0 * pm.num_attention_heads * pm.kv_channels * pm.seq_length * tokens)
        seconds = (three - one) / 2 - overhead_s
        return flops / seconds if seconds > 0 else float("nan")

    def close(self) -> None:
        self.ps.destroy()
