"""--fp8-param-gather on two gloo ranks (dp 2, distributed optimizer, a bucket per
parameter, so that every weight is cut between the ranks' shards):

- the parameter all-gather after each step sends every fp8 linear's weight as fp8 bytes,
  ``N / D`` per rank where bf16 sends ``2 N / D``; every other parameter in bf16;
- the scale each owner quantises with is the whole weight's: an owner that used its own
  shard's amax (the planted bug) quantises differently from the one-process run, and the
  comparison of tests/fuzz/check.py reports it (the same row unplanted is in
  tests/layouts.py, run by tests/fp8/test_layouts.py).
"""

import dataclasses
from collections import Counter

import torch

from tests.distributed.harness import run_distributed
from tests.fuzz import check
from tests.layouts import by_name

ROW = "fp8-dp2-distopt-tensorwise-param-gather-small-buckets"


def _counting_rank(rank: int, world_size: int, layout):
    """Train ``layout``; every all-gather over ``dp_cp`` as ``(dtype, bytes sent)``, the
    ``(numel, holds an fp8 weight)`` of every dense bucket, the losses, and how many times
    a rank computed its fp8 weights' scales (packed its row)."""
    from megalite.optim import data_parallel
    from megalite.optim.fp8_param_gather import Fp8BucketGather
    from megalite.parallel import collectives

    sent, buckets, packs = [], [], []
    gather, attach = collectives.all_gather_into_tensor, data_parallel.fp8_param_gather_attach
    scales = Fp8BucketGather._scales

    def counting_scales(self, shard):
        packs.append(self.bucket.numel)
        return scales(self, shard)

    def counting(out, x, group, async_op=False):
        if group.name == "dp_cp":
            sent.append((str(x.dtype), x.numel() * x.element_size()))
        return gather(out, x, group, async_op=async_op)

    def attaching(buffers, chunks):
        n = attach(buffers, chunks)
        buckets.extend((bk.numel, bk.fp8_gather is not None)
                       for buf in buffers for bk in buf.buckets)
        return n

    collectives.all_gather_into_tensor = counting
    data_parallel.fp8_param_gather_attach = attaching
    Fp8BucketGather._scales = counting_scales
    try:
        losses, _, _ = check.train_and_gather(layout)
    finally:
        collectives.all_gather_into_tensor = gather
        data_parallel.fp8_param_gather_attach = attach
        Fp8BucketGather._scales = scales
    return sent, buckets, losses, packs


def test_gathered_weights_are_fp8_bytes():
    layout = by_name(ROW)
    layout = dataclasses.replace(layout, model={**layout.model, "bf16": True})
    ranks = run_distributed(2, _counting_rank, layout)
    for sent, buckets, losses, packs in ranks:
        assert len(losses) == check.ITERS
        assert len(packs) == 8 * check.ITERS     # each fp8 bucket quantised once a step
        fp8 = [n for n, is_fp8 in buckets if is_fp8]
        plain = [n for n, is_fp8 in buckets if not is_fp8]
        assert len(fp8) == 8 and plain      # 2 layers x (qkv, proj, fc1, fc2)
        # after each of the 3 steps: one uint8 row of N / 2 bytes per fp8 bucket (each a
        # multiple of 16 here, no row padding); at the end (the parameters read for the
        # comparison) the same buckets once more in bf16
        want_fp8 = sorted(n // 2 for n in fp8) * check.ITERS
        got_fp8 = sorted(b for dtype, b in sent if dtype == "torch.uint8")
        assert got_fp8 == sorted(want_fp8)
        got_bf16 = sorted(b for dtype, b in sent if dtype == "torch.bfloat16")
        want_bf16 = sorted([n for n in plain] * check.ITERS + [n for n in fp8])  # 2 N / 2
        assert got_bf16 == want_bf16
        # the fp8 weights' part of a step's gather is half of bf16's
        assert sum(n // 2 for n in fp8) * 2 == sum(fp8)


def _local_amax_rank(rank: int, world_size: int, layout):
    """Train ``layout`` with the planted bug: each owner scales its piece of a weight by
    the amax of that piece alone (no MAX over the other shards or tp)."""
    from megalite.layers.fp8.recipes import amax_of, dequant_scale
    from megalite.optim.fp8_param_gather import Fp8BucketGather

    real = Fp8BucketGather._scales

    def local(self, shard):
        lo, hi = self.bucket.shard_range()
        out = []
        for _, a, b, scaling in self.fp8:
            piece = shard[max(a, lo) - lo:max(min(b, hi), lo) - lo]
            out.append(dequant_scale(amax_of(piece), scaling.recipe.forward_dtype))
        return out

    Fp8BucketGather._scales = local
    try:
        return check.train_and_gather(layout)
    finally:
        Fp8BucketGather._scales = real


def test_local_shard_amax_is_caught():
    layout = by_name(ROW)
    ranks = run_distributed(2, _local_amax_rank, layout)
    problems = check.compare(layout, ranks, check.reference(layout))
    assert any("lm_loss" in p or "max diff" in p for p in problems), problems
    assert torch.isfinite(torch.tensor([loss for losses, _, _ in ranks
                                        for loss in losses.values()])).all()


def test_zero3_gathers_fp8_weights_per_layer():
    """ZeRO-3 gathers each layer's buckets around its forward and backward, each time with
    the fp8 weights as fp8 bytes: a freed unit keeps no fp8 copies, so none outlives its
    gather. Each rank quantises its pieces once per step (scales and amax collectives
    included) and sends the same row at the step's later gathers; the final read gathers
    the weights in bf16."""
    layout = by_name(ROW)
    parallel = {k: v for k, v in layout.parallel.items() if k != "use_distributed_optimizer"}
    layout = dataclasses.replace(layout, model={**layout.model, "bf16": True}, parallel={
        **parallel, "data_parallel_sharding_strategy": "optim_grads_params"})
    for sent, buckets, losses, packs in run_distributed(2, _counting_rank, layout):
        assert len(losses) == check.ITERS
        fp8 = [n for n, is_fp8 in buckets if is_fp8]
        assert len(fp8) == 8
        assert sorted(packs) == sorted(fp8 * check.ITERS)
        rows = Counter(b for dtype, b in sent if dtype == "torch.uint8")
        assert set(rows) == {n // 2 for n in fp8}
        # every gather (a forward and a backward per micro-batch) in fp8, but the first
        # forward's: it runs on the parameters the model was built with
        train = check.config(layout).train
        micro = train.global_batch_size // (train.micro_batch_size * 2)      # dp 2
        per_size = Counter(n // 2 for n in fp8)
        assert rows == {size: (2 * micro * check.ITERS - 1) * k
                        for size, k in per_size.items()}


def _save_rank(rank: int, world_size: int, layout, root: str) -> None:
    """Train ``layout`` and save at its last iteration into ``root``."""
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from megalite.training.loop import train

    cfg = check.config(layout)
    cfg.checkpoint.save, cfg.checkpoint.save_interval = root, check.ITERS
    ps = ParallelState.build(cfg.parallel)
    try:
        c = build_components(cfg, ps, datasets_provider=check.datasets,
                             peak_probe_seconds=0.01)
        try:
            train(c)
        finally:
            c.close()
    finally:
        ps.destroy()


def _weights(root: str) -> dict:
    """The checkpoint's weights, read back here as one tp=1 model."""
    from megalite.checkpoint.consolidated import load_full_model

    _, model = load_full_model(root)
    return {k: v.clone() for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_checkpoint_holds_the_weights_not_their_fp8_copies(tmp_path):
    """A save right after an fp8 gather writes the weights themselves (gathered again in
    their dtype): the same checkpoint, bit for bit, as the run without the flag."""
    layout = by_name(ROW)
    plain = dataclasses.replace(layout, model={k: v for k, v in layout.model.items()
                                               if k != "fp8_param_gather"})
    for lay, name in ((layout, "fp8"), (plain, "plain")):
        run_distributed(2, _save_rank, lay, str(tmp_path / name))
    got, want = _weights(str(tmp_path / "fp8")), _weights(str(tmp_path / "plain"))
    assert got.keys() == want.keys() and any("linear_fc1.weight" in k for k in got)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
