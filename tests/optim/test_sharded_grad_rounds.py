"""ZeRO-2 gradients (``optim_grads``) never held whole: each bucket is reduce-scattered into
this rank's shard once per micro-batch, as soon as all its parameters have their gradient,
and its full gradient dropped (gloo, dp 2, three micro-batches per step).

Checked against the distributed optimizer (``optim``), which sums the micro-batches in a
full buffer and reduce-scatters once: the same reduced shard (fp32, only the order of the
sums differs), one reduction per bucket and micro-batch, and at most the buckets of the
backward in flight held in full while a micro-batch's backward runs.
"""

import pytest
import torch

from megalite.config import ParallelConfig
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.grad_buffer import Bucket
from megalite.parallel.state import ParallelState
from tests.distributed.harness import run_distributed

MICRO, STEPS, LAYERS, WIDTH = 3, 2, 4, 16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _step(model, grads, rank: int, step: int) -> None:
    grads.zero_grad(num_microbatches=MICRO)
    for micro in range(MICRO):
        g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
        model(torch.randn(4, WIDTH, generator=g)).tanh().pow(2).sum().backward()
    grads.finish_grad_sync()


def _body(rank, world_size, overlap):
    ps = ParallelState.build(ParallelConfig())
    try:
        out = {}
        for strategy in ("optim", "optim_grads"):
            model = _model()
            grads = DataParallelGrads(model, ps, bucket_size=WIDTH * WIDTH + WIDTH,
                                      use_distributed_optimizer=True,
                                      overlap_grad_reduce=overlap,
                                      shard_grads=strategy == "optim_grads")
            grads.trace = []
            held, opened = [], Bucket.open_round

            def open_round(bucket, opened=opened, grads=grads):
                opened(bucket)
                held.append(sum(t.numel() for b in grads.buffers for t in b.round_tensors()))

            Bucket.open_round = open_round
            try:
                for step in range(STEPS):
                    _step(model, grads, rank, step)
            finally:
                Bucket.open_round = opened
            buf = grads.buffers[0]
            shards = [bucket.shard_grad().clone() for bucket in buf.buckets]
            rounds = [e for e in grads.trace if e[0] == "grad-round-start"]
            stray = "readable" if hasattr(model[0].weight, "main_grad") else "gone"
            out[strategy] = (shards, rounds, held, buf.total, len(buf.buckets),
                             buf.grad_data.numel(), stray)
        return out
    finally:
        ps.destroy()


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlap"])
def test_each_bucket_is_reduced_per_micro_batch_and_never_held_whole(overlap):
    for out in run_distributed(2, _body, overlap):
        shards, rounds, held, total, buckets, full, stray = out["optim_grads"]
        want, want_rounds, _, _, _, want_full, want_stray = out["optim"]
        assert buckets == LAYERS and full == 0 and want_full == total
        # every bucket once per micro-batch, the last layer's first (backward order)
        assert len(rounds) == buckets * MICRO * STEPS and want_rounds == []
        assert [r[3] for r in rounds[:buckets]] == list(range(buckets))
        for got, ref in zip(shards, want):
            assert got.numel() == ref.numel() > 0
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            assert float(ref.abs().max()) > 1e-3
        # while a backward runs, one bucket (two with the previous one's reduction in
        # flight) of the four is held in full
        per_bucket = total // buckets
        assert held and max(held) <= (2 if overlap else 1) * per_bucket < total
        assert stray == "gone" and want_stray == "readable"
