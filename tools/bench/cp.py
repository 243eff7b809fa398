"""Context parallelism: per-rank attention memory, time and bytes against cp, by comm type.

``python tools/benchmark.py cp [--seq-length 16384] [--num-attention-heads 8]
[--num-query-groups 4] [--kv-channels 64] [--ranks 1 2 4] [--attention-backend sdpa]
[--repeat 1] [--cp-comm-type p2p allgather a2a]``

One attention layer's core (q, k, v of a ``[seq, 1, heads, head_dim]`` sequence, fp32,
causal) forward + backward on ``cp`` gloo ranks (one thread each), for each comm type:

* ``saved MiB``: the bytes autograd keeps for the backward on one rank (the attention's
  activation memory; ``saved_tensors_hooks``, each storage counted once), and ``peak MiB``
  its largest single tensor;
* ``ms``: forward + backward wall time, the slowest rank, best of ``--repeat``;
* ``sent MiB``: bytes one rank hands to the cp collectives for other ranks, measured by
  wrapping ``megalite.parallel.collectives`` (all-gather, reduce-scatter, all-to-all, ring
  exchange), against ``theory``:
  p2p ``(cp-1) kv + (cp-1) kv + cp dkv``; allgather ``2 (cp-1) kv``;
  a2a ``2 (cp-1)/cp (q + k + v + out)``, with ``kv`` this rank's keys+values, ``dkv`` their
  fp32 gradients.

Then the crossover in bytes: a2a sends less than allgather/p2p once
``cp > heads/groups + 1`` (its traffic per rank falls as 1/cp of q, k, v and the output,
the others' grows with cp x kv), printed for the given head/group counts.
"""

from __future__ import annotations

import argparse
import time

import torch

from tools.bench import _ranks


class _Wire:
    """Bytes passed to the cp collectives for other ranks: ``with _Wire() as wire:`` wraps
    collectives' functions, counting into ``wire.sent``, and puts them back on exit."""

    NAMES = ("_all_gather_single", "_reduce_scatter_single", "all_to_all", "ring_exchange")

    def __init__(self):
        self.sent = 0
        self.originals = ()

    def __enter__(self) -> _Wire:
        from megalite.parallel import collectives as C

        self.originals = tuple(getattr(C, name) for name in self.NAMES)
        gather, scatter, a2a, ring = self.originals

        def all_gather(out, x, group=None, async_op=False):
            n = out.numel() // x.numel()
            self.sent += (n - 1) * x.numel() * x.element_size()
            return gather(out, x, group=group, async_op=async_op)

        def reduce_scatter(out, x, group=None, async_op=False):
            self.sent += (x.numel() - out.numel()) * x.element_size()
            return scatter(out, x, group=group, async_op=async_op)

        def all_to_all(x, group, send=None, recv=None):
            self.sent += x.numel() * x.element_size() * (group.size - 1) // group.size
            return a2a(x, group, send, recv)

        def ring_exchange(x, group):
            self.sent += x.numel() * x.element_size() if group.size > 1 else 0
            return ring(x, group)

        for name, fn in zip(self.NAMES, (all_gather, reduce_scatter, all_to_all, ring_exchange)):
            setattr(C, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        from megalite.parallel import collectives as C

        for name, fn in zip(self.NAMES, self.originals):
            setattr(C, name, fn)


def _shape(args) -> tuple[int, int, int, int]:
    """(sequence, heads, query groups, head dim) of the benchmarked attention."""
    return args.seq_length, args.num_attention_heads, args.num_query_groups, args.kv_channels


def _theory(comm: str, cp: int, s_local: int, heads: int, groups: int, d: int) -> int:
    kv = 2 * s_local * groups * d * 4
    if cp == 1:
        return 0
    if comm == "p2p":
        return 2 * (cp - 1) * kv + cp * kv
    if comm == "allgather":
        return 2 * (cp - 1) * kv
    qkvo = (2 * heads + 2 * groups) * s_local * d * 4
    return 2 * (cp - 1) * qkvo // cp


def _kernel(args, ps, comm: str):
    """The core attention of ``--attention-backend`` with ``comm`` as its cp comm type."""
    from megalite.parallel.random import RNGTracker
    from megalite.transformer.attention_kernels import build_core_attention

    class Cfg:
        attention_backend, cp_comm_type, attention_dropout = args.attention_backend, comm, 0.0

    return build_core_attention(Cfg, ps, RNGTracker.from_state(ps, 1))


def _inputs(args, idx):
    """q, k, v (leaves) of the sequence positions ``idx`` and the output's gradient."""
    g = torch.Generator().manual_seed(0)
    s, h, ng, d = _shape(args)
    q = torch.randn(s, 1, h, d, generator=g)[idx].requires_grad_()
    k = torch.randn(s, 1, ng, d, generator=g)[idx].requires_grad_()
    v = torch.randn(s, 1, ng, d, generator=g)[idx].requires_grad_()
    return q, k, v, torch.randn(len(idx), 1, h * d, generator=g)


def _measure(kernel, inputs, repeat: int, wire=None, sync=lambda: None) -> tuple:
    """(best seconds, saved bytes, largest saved storage, bytes sent) of ``repeat``
    forward + backward passes; the bytes are the last pass's."""
    q, k, v, grad = inputs
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    best = float("inf")
    for _ in range(repeat):
        saved.clear()
        if wire is not None:
            wire.sent = 0
        sync()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = kernel(q, k, v)
        out.backward(grad)
        best = min(best, time.perf_counter() - t0)
        for t in (q, k, v):
            t.grad = None
    return (best, sum(saved.values()), max(saved.values(), default=0),
            wire.sent if wire is not None else 0)


def _body(rank, world, args, comms):
    """On one rank of a cp world: per comm type, (the slowest rank's seconds, saved bytes,
    largest saved storage, bytes sent, theory's bytes)."""
    import torch.distributed as dist

    from megalite.config import ParallelConfig
    from megalite.parallel.cp_chunks import chunk_positions
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig(context_parallel_size=world))
    s, h, ng, d = _shape(args)
    idx = chunk_positions(s, world, rank)
    out = {}
    with _Wire() as wire:
        for comm in comms:
            best, saved, peak, sent = _measure(_kernel(args, ps, comm), _inputs(args, idx),
                                               args.repeat, wire, sync=dist.barrier)
            slowest = torch.tensor([best])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            out[comm] = (float(slowest), saved, peak, sent,
                         _theory(comm, world, len(idx), h, ng, d))
    ps.destroy()
    return out


def _single(args):
    """cp 1: the plain kernel in this process (one thread, like a rank)."""
    from megalite.config import ParallelConfig
    from megalite.parallel.state import ParallelState

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ps = ParallelState.build(ParallelConfig())
        inputs = _inputs(args, torch.arange(args.seq_length))
        return (*_measure(_kernel(args, ps, "p2p"), inputs, args.repeat), 0)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str]) -> dict:
    """Print the table; return its rows, ``{(cp, comm): (seconds, saved bytes, largest
    saved storage, bytes sent, theory's bytes)}``."""
    p = argparse.ArgumentParser(prog="benchmark.py cp")
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--kv-channels", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p", "allgather", "a2a"])
    p.add_argument("--attention-backend", default="sdpa", choices=("sdpa", "local"))
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    mib = 2 ** 20
    s, h, ng, d = _shape(args)
    print(f"attention core, seq {s}, {h} heads / {ng} groups x {d}, fp32, backend "
          f"{args.attention_backend}, fwd+bwd, 1 thread per rank")
    print(f"{'cp':>3} {'comm':<10} {'ms':>9} {'saved MiB':>10} {'peak MiB':>9} "
          f"{'sent MiB':>9} {'theory':>9} {'ratio':>6}")
    rows = {}
    for cp in args.ranks:
        comms = args.cp_comm_type if cp > 1 else ["(none)"]
        skipped = [c for c in comms if c == "a2a" and (h % cp or ng % cp)]
        runnable = [c for c in comms if c not in skipped]
        if cp == 1:
            results = {"(none)": _single(args)}
        else:
            results = _ranks.run_on_ranks(_body, cp, args, runnable)[0] if runnable else {}
        for comm in comms:
            if comm in skipped:
                print(f"{cp:>3} {comm:<10} skipped: heads/groups not divisible by cp")
                continue
            res = results[comm]
            ms, saved, peak, sent, theory = res
            rows[(cp, comm)] = res
            ratio = f"{sent / theory:.2f}" if theory else "-"
            print(f"{cp:>3} {comm:<10} {ms * 1e3:>9.0f} {saved / mib:>10.1f} "
                  f"{peak / mib:>9.1f} {sent / mib:>9.2f} {theory / mib:>9.2f} {ratio:>6}",
                  flush=True)
    for cp in args.ranks:
        done = {c: r for (k, c), r in rows.items() if k == cp and cp > 1}
        if done:
            fastest = min(done, key=lambda c: done[c][0])
            fewest = min(done, key=lambda c: done[c][3])
            print(f"cp {cp}: fastest {fastest}, fewest bytes {fewest}")
    ratio = h / ng
    print(f"bytes crossover (theory): a2a sends less than allgather once cp > heads/groups "
          f"+ 1 = {ratio + 1:g}; p2p sends (3 cp - 2)/(2 cp - 2) x allgather's "
          f"(the fp32 key/value gradients travel the ring)")
    return rows
