"""``--data-parallel-sharding-strategy optim_grads_params`` (ZeRO-3): parameters sharded
over data parallelism, each layer gathered before its forward and its backward.

One world-2 call trains the tiny GPT (bf16 with fp32 masters, gradient clipping at 1.0,
micro-batch 1: 4 micro-batches per rank accumulate) and checks:

- bitwise the same as ``optim_grads`` (losses, final parameters, per-parameter optimizer
  state), also with overlapped reduction and half the optimizer state offloaded, and with
  full activation recomputation (against optim_grads with the same recomputation).
  ``--ddp-bucket-size 1`` puts every parameter in a bucket of its own, so both strategies
  lay out the same buckets (optim_grads_params closes a bucket at every layer, and the
  order in which gloo sums a bucket's elements over ranks depends on its length at dp > 2);
- between steps a rank holds ``(2 + 4 + 12) / 2`` bytes per parameter (measured storages),
  every gathered copy is freed, and a parameter read then is NaN (its placeholder);
- each unit (embedding, each layer, final norm, output layer) is gathered once per forward
  and once per backward of every micro-batch and freed after each (the trace), and while a
  step runs at most two neighbouring units are gathered at once (the prefetch);
- checkpoints move between strategies: saved under optim_grads_params at iteration 2 and
  resumed under optim (and the other way round), the losses continue the straight run's
  bit for bit.
"""

import collections
import os

import pytest
import torch

from megalite.optim.memory import expected_bytes_per_param, rank_memory
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components
from megalite.training.loop import train
from tests.distributed.harness import run_distributed
from tests.optim.common import DATASETS, assert_bitwise_same, config, full_params, train_run

OGP = "optim_grads_params"
BF16 = {"bf16": True}
OFFLOAD_HALF = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 2}
RUNS = {   # name -> (model, parallel, optim); every one at --ddp-bucket-size 1
    "optim_grads": (BF16, {"data_parallel_sharding_strategy": "optim_grads"}, {}),
    OGP: (BF16, {"data_parallel_sharding_strategy": OGP}, {}),
    f"{OGP}+ogr+offload0.5": (BF16, {"data_parallel_sharding_strategy": OGP,
                                     "overlap_grad_reduce": True}, OFFLOAD_HALF),
    "optim_grads+recompute": ({**BF16, **FULL_RECOMPUTE},
                              {"data_parallel_sharding_strategy": "optim_grads"}, {}),
    f"{OGP}+recompute": ({**BF16, **FULL_RECOMPUTE},
                         {"data_parallel_sharding_strategy": OGP}, {}),
}
ITERS = 3


def _cfg(world_size, model, parallel, optim, iters=ITERS):
    cfg = config(world_size, iters=iters, model=model, optim=optim,
                 **{"ddp_bucket_size": 1, **parallel})
    cfg.train.micro_batch_size = 1        # 4 micro-batches per rank at dp 2
    return cfg.validate(world_size)


def _sharded_run(cfg, ps):
    """Train, recording the gather trace and the peak of gathered bytes after the first
    step (the model starts gathered whole); measure memory between steps."""
    c = build_components(cfg, ps, datasets_provider=DATASETS, peak_probe_seconds=0.01)
    try:
        sharding = c.grads.param_sharding
        sharding.trace = []
        step = c.optimizer.step

        def step_then_reset():
            outcome = step()
            if c.optimizer.num_steps == 1:
                sharding.reset_peak()
            return outcome

        c.optimizer.step = step_then_reset
        result = train(c)
        memory = rank_memory(c.model, c.grads, c.optimizer)
        stray = next(c.model.parameters())
        between = {"memory": memory, "gathered": sharding.gathered_bytes,
                   "nan": bool(torch.isnan(stray).all()),
                   "trace": collections.Counter(sharding.trace),
                   "peak": sharding.peak_gathered_bytes,
                   "pairs": max(sum(b.param.numel() * b.param.element_size()
                                    for b in {*u.buckets, *v.buckets})
                                for u, v in zip(sharding.units, sharding.units[1:])),
                   "units": [u.name for u in sharding.units]}
        try:
            with torch.no_grad():
                stray.add_(1.0)                # the placeholder refuses writes
            between["write"] = "accepted"
        except RuntimeError as e:
            between["write"] = str(e)
        c.grads.finish_param_sync()
        params = full_params(c.model)
        state = c.optimizer.state_dict_per_param()
    finally:
        c.close()
    return result.losses, params, state, between


def _body(rank, world_size, tmp):
    out = {}
    ps = ParallelState.build(config(world_size).parallel)
    try:
        for name, (model, parallel, optim) in RUNS.items():
            cfg = _cfg(world_size, model, parallel, optim)
            if parallel["data_parallel_sharding_strategy"] == OGP:
                out[name] = _sharded_run(cfg, ps)
            else:
                losses, params, _, state = train_run(
                    cfg, ps=ps, inspect=lambda c: c.optimizer.state_dict_per_param())
                out[name] = (losses.losses, params, state, None)
        for first, then in ((OGP, "optim"), ("optim", OGP)):
            save = os.path.join(tmp, f"{first}-ckpt")
            saving = _cfg(world_size, BF16, {"data_parallel_sharding_strategy": first}, {},
                          iters=4)
            saving.train.exit_interval, saving.checkpoint.save = 2, save
            saved = train_run(saving, ps=ps)[0].losses
            again = _cfg(world_size, BF16, {"data_parallel_sharding_strategy": then}, {},
                         iters=4)
            again.checkpoint.load = save
            resumed = train_run(again, ps=ps)[0].losses
            straight = _cfg(world_size, BF16, {"data_parallel_sharding_strategy": first}, {},
                            iters=4)
            out[f"{first}->{then}"] = (saved, resumed, train_run(straight, ps=ps)[0].losses)
    finally:
        ps.destroy()
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_distributed(2, _body, str(tmp_path_factory.mktemp("param_sharding")))


@pytest.mark.parametrize("name, reference", [
    (OGP, "optim_grads"), (f"{OGP}+ogr+offload0.5", "optim_grads"),
    (f"{OGP}+recompute", "optim_grads+recompute")])
def test_bitwise_the_same_as_optim_grads(world2, name, reference):
    for out in world2:
        assert_bitwise_same(out[name][:3], out[reference][:3], ITERS, name)


@pytest.mark.parametrize("name", [OGP, f"{OGP}+recompute"])
def test_only_shards_are_held_between_steps(world2, name):
    for out in world2:
        between = out[name][3]
        mem = between["memory"]
        want = expected_bytes_per_param(OGP, 2)
        assert want == {"params": 1, "grads": 2, "optimizer": 6}
        # + one bf16 element: the NaN placeholder the freed parameters point at
        assert mem.params == pytest.approx(want["params"] * mem.num_params, rel=0.03)
        assert mem.grads == pytest.approx(want["grads"] * mem.num_params, rel=0.03)
        assert mem.optimizer == pytest.approx(want["optimizer"] * mem.num_params, rel=0.03)
        assert between["gathered"] == 0 and between["nan"]
        assert "more than one element" in between["write"]


def test_each_layer_is_gathered_and_freed_around_forward_and_backward(world2):
    micro = 4
    for out in world2:
        between = out[OGP][3]
        assert between["units"] == ["embedding", "decoder.layers.0", "decoder.layers.1",
                                    "decoder.final_layernorm", "output_layer"]
        for unit in between["units"]:
            # every forward and backward of every micro-batch but the first forward (the
            # model starts gathered, and that forward frees it), and nothing is left
            want = 2 * micro * ITERS - 1
            assert between["trace"][("gather", unit)] == want, unit
            assert between["trace"][("free", unit)] == want + 1, unit
        # at most two neighbouring units at once (a layer and the prefetched next one)
        assert 0 < between["peak"] <= between["pairs"], between


@pytest.mark.parametrize("first, then", [(OGP, "optim"), ("optim", OGP)])
def test_checkpoints_move_between_strategies(world2, first, then):
    for out in world2:
        saved, resumed, straight = out[f"{first}->{then}"]
        assert list(saved) == [1, 2] and list(resumed) == [3, 4]
        assert {**saved, **resumed} == straight


def _fsdp2_body(rank, world_size):
    """fully_shard on megalite's GPT (dp 2): forward and backward run, megalite's gradient
    buffers cannot be built over its DTensor parameters."""
    from torch.distributed.fsdp import fully_shard

    from megalite.optim.data_parallel import DataParallelGrads
    from megalite.training.build import default_model_provider

    cfg = config(world_size)
    ps = ParallelState.build(cfg.parallel)
    try:
        model = default_model_provider(cfg, ps)
        for layer in model.decoder.layers.values():
            fully_shard(layer)
        fully_shard(model)
        ids = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).float().mean().backward()
        kinds = {type(p).__name__ for p in model.parameters()}
        try:
            DataParallelGrads(model, ps, use_distributed_optimizer=True)
            error = None
        except RuntimeError as e:
            error = str(e)
    finally:
        ps.destroy()
    return kinds, error


def test_torch_fsdp2_does_not_compose_with_the_grad_buffers():
    """What --use-torch-fsdp2's refusal says, measured."""
    for kinds, error in run_distributed(2, _fsdp2_body):
        assert kinds == {"DTensor"}
        assert error is not None and "got mixed torch.Tensor and DTensor" in error
