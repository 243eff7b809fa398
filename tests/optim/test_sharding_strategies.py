"""Sharding strategies beyond ZeRO-1 and optimizer CPU offload.

One world-2 call (dp 2, the tiny GPT in bf16 with fp32 masters, 4 iterations) trains with
``--data-parallel-sharding-strategy optim`` (the distributed optimizer), ``optim_grads``
(gradients sharded too) and both with ``--optimizer-cpu-offload`` (fraction 0.5 and 1),
then checks:

- the four runs are bitwise the same (losses, final parameters, per-parameter optimizer
  state): sharding the gradients and stepping pieces on the host change no arithmetic, and
  on this CPU-only host the offloaded pieces take the same code path as on a GPU (copies
  of masters and gradients into host buffers, a torch optimizer of their own);
- between steps optim_grads holds only its shard of the fp32 gradients: the full buffer's
  is dropped (reading ``main_grad`` raises), the shard holds the data-parallel SUM that the
  optim run's full buffer holds in that range;
- a checkpoint saved at optim_grads + offload dp 2 after iteration 2 resumes at
  ``no_shard`` dp 1 (this process) and continues the dp-1 curve within the equivalence
  tolerance (fp32: only the order of sums differs), and continues exactly what the saving
  run would have done when resumed at the same layout under another strategy (optim, no
  offload).
"""

import os

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.parallel.device import host_memory_pinned
from megalite.optim.memory import expected_bytes_per_param
from megalite.parallel.state import ParallelState
from tests.distributed.harness import run_distributed
from tests.optim.common import assert_bitwise_same, config, train_run

BF16 = {"bf16": True}
OFFLOAD_HALF = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
OFFLOAD_ALL = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
RUNS = {   # name -> (parallel, optim)
    "optim": ({"data_parallel_sharding_strategy": "optim"}, {}),
    "optim_grads": ({"data_parallel_sharding_strategy": "optim_grads",
                     "overlap_grad_reduce": True}, {}),
    "optim+offload0.5": ({"use_distributed_optimizer": True}, OFFLOAD_HALF),
    "optim_grads+offload1": ({"data_parallel_sharding_strategy": "optim_grads"}, OFFLOAD_ALL),
}


def _inspect(c):
    """Per-parameter optimizer state, and the gradient storage after the last step:
    (full buffer bytes, reduced shards) per buffer."""
    buffers = [(b.grad_data.numel() * b.grad_data.element_size(),
                [bk.shard_grad().clone() for bk in b.buckets]) for b in c.grads.buffers]
    try:
        next(iter(c.grads.params)).main_grad.sum()
        touched = "ok"
    except AttributeError as e:
        touched = str(e)
    return c.optimizer.state_dict_per_param(), buffers, touched


def _body(rank, world_size, tmp):
    out = {}
    ps = ParallelState.build(config(world_size).parallel)
    try:
        for name, (parallel, optim) in RUNS.items():
            cfg = config(world_size, iters=4, model=BF16, optim=optim, **parallel)
            result, params, memory, extra = train_run(cfg, ps=ps, inspect=_inspect)
            out[name] = (result.losses, params, memory, extra)
        save = os.path.join(tmp, "ckpt")
        first = config(world_size, iters=4, optim=OFFLOAD_HALF,
                       data_parallel_sharding_strategy="optim_grads")
        first.train.exit_interval, first.checkpoint.save = 2, save
        out["saved"] = train_run(first, ps=ps)[0].losses
        again = config(world_size, iters=4, data_parallel_sharding_strategy="optim")
        again.checkpoint.load = save
        out["resumed-dp2-optim"] = train_run(again, ps=ps)[0].losses
        straight = config(world_size, iters=4, data_parallel_sharding_strategy="optim_grads")
        out["straight-dp2"] = train_run(straight, ps=ps)[0].losses
    finally:
        ps.destroy()
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sharding"))
    return tmp, run_distributed(2, _body, tmp)


def test_strategies_and_offload_are_bitwise_the_same(world2):
    for out in world2[1]:
        losses, params, _, (state, _, _) = out["optim"]
        for name in RUNS:
            got_losses, got_params, _, (got_state, _, _) = out[name]
            assert_bitwise_same((got_losses, got_params, got_state), (losses, params, state),
                                4, name)


def test_optim_grads_keeps_only_the_reduced_shard(world2):
    for out in world2[1]:
        _, _, mem, (_, full, touched) = out["optim"]
        _, _, mem_og, (_, sharded, touched_og) = out["optim_grads"]
        assert touched == "ok" and "main_grad" in touched_og   # a freed buffer is loud
        for (full_bytes, want), (bytes_og, got) in zip(full, sharded):
            assert full_bytes > 0 and bytes_og == 0
            for a, b in zip(got, want):
                assert a.numel() == b.numel() > 0 and torch.equal(a, b)
        n = mem.num_params
        assert mem.grads == pytest.approx(4 * n, rel=0.03)
        want = expected_bytes_per_param("optim_grads", 2)
        assert want == {"params": 2, "grads": 2, "optimizer": 6}
        assert mem_og.grads == pytest.approx(want["grads"] * n, rel=0.03)
        assert mem_og.params == pytest.approx(want["params"] * n, rel=0.03)
        assert mem_og.optimizer == pytest.approx(want["optimizer"] * n, rel=0.03)


def test_offload_moves_the_optimizer_bytes_to_the_host(world2):
    for out in world2[1]:
        mem = out["optim"][2]
        half, whole = out["optim+offload0.5"][2], out["optim_grads+offload1"][2]
        assert whole.optimizer == 0
        # host: fp32 master + fp32 gradient copy + two moments per offloaded element
        assert whole.offloaded == pytest.approx(16 / 12 * mem.optimizer, rel=0.03)
        assert half.optimizer + half.offloaded * 12 / 16 == pytest.approx(mem.optimizer,
                                                                          rel=0.03)
        # at least half the elements (whole pieces, first to last) went to the host
        assert 0.25 < half.optimizer / mem.optimizer <= 0.5 + 1e-3


def test_checkpoint_of_optim_grads_resumes_at_no_shard_dp1(world2):
    tmp, outs = world2
    saved, again, straight = (outs[0][k] for k in ("saved", "resumed-dp2-optim",
                                                   "straight-dp2"))
    assert list(saved) == [1, 2] and list(again) == [3, 4]
    assert {**saved, **again} == straight     # another strategy, same layout: exact
    cfg = config(1, iters=4, data_parallel_sharding_strategy="no_shard")
    cfg.checkpoint.load = os.path.join(tmp, "ckpt")
    resumed = train_run(cfg)[0].losses
    reference = train_run(config(1, iters=4))[0].losses
    assert list(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(reference[it], abs=1e-5)
        assert resumed[it] == pytest.approx(straight[it], abs=1e-5)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "60"]


@pytest.mark.parametrize("flags, strategy, distributed", [
    ([], "no_shard", False),
    (["--use-distributed-optimizer"], "optim", True),
    (["--data-parallel-sharding-strategy", "optim"], "optim", True),
    (["--data-parallel-sharding-strategy", "optim_grads"], "optim_grads", True),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"],
     "optim_grads", True),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], "optim_grads_params", True),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--optimizer-cpu-offload"],
     "optim_grads_params", True),
])
def test_strategy_flags(flags, strategy, distributed):
    p = parse_args(BASE + flags).validate(2).parallel
    assert (p.data_parallel_sharding_strategy, p.use_distributed_optimizer) == \
        (strategy, distributed)


@pytest.mark.parametrize("flags, message", [
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 is not supported: .* got mixed torch.Tensor "
     "and DTensor.*; use --data-parallel-sharding-strategy optim_grads_params"),
    (["--data-parallel-sharding-strategy", "zero3"], "invalid choice: .zero3."),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--compile"],
     "optim_grads_params with --compile is not supported yet"),
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload with "
     "--data-parallel-sharding-strategy no_shard is not supported yet"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload",
      "--optimizer-offload-fraction", "1.5"], "optimizer_offload_fraction must be in"),
])
def test_bad_flags_fail_clearly(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + flags).validate(2)


def test_offload_needs_pinned_host_memory():
    flag = "--optimizer-cpu-offload"
    assert host_memory_pinned(torch.device("cpu"), flag) is False   # host and device are one
    with pytest.raises(ConfigError, match=f"{flag} needs pinned host memory, which device meta"):
        host_memory_pinned(torch.device("meta"), flag)
    ocfg = parse_args(BASE + ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                              "--optimizer-offload-fraction", "0.25"]).validate(2).optim
    assert (ocfg.optimizer_cpu_offload, ocfg.optimizer_offload_fraction) == (True, 0.25)
