"""The planner's memory model for the data-parallel sharding strategies and optimizer CPU
offload: its bytes between steps equal what megalite's ranks hold
(:func:`megalite.optim.memory.rank_memory`, as ``tools/bench/memory.py`` measures them), its
search proposes them with the flags megalite accepts, and ZeRO's published accounting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megalite.arguments import parse_args
from megalite.planner.cluster import GIB, Cluster, preset
from megalite.planner.memory import estimate_memory, state_bytes
from megalite.planner.search import STRATEGIES, search
from tests.planner.test_plan_layout import SMALL

BENCH = SimpleNamespace(num_layers=2, hidden_size=64, vocab_size=256,
                        tensor_model_parallel_size=1, grad_reduce_in_bf16=False,
                        optimizer_offload_fraction=0.5)


def _measure_body(rank: int, world: int) -> list[tuple]:
    import torch

    from tools.bench.memory import _runs, measure

    torch.set_num_threads(1)
    rows = []
    for run in _runs(BENCH):
        name, strategy, offload, mem = measure(BENCH, world, run)[:4]
        rows.append((name, strategy, offload, mem.params, mem.grads, mem.optimizer,
                     mem.offloaded, mem.num_params))
    return rows


def test_state_bytes_equal_the_measured_rank_memory():
    """dp 2, bf16 GPT: every strategy and offload row of tools/bench/memory.py; parameter
    counts exact, bytes within 0.1% (bucket padding, Adam's step counters); with offload,
    device + host optimizer bytes in total (whole parameters move to the host, so the split
    is at least the fraction)."""
    from tests.distributed.harness import run_distributed

    from tools.bench.memory import _config

    world = 2
    per_rank = run_distributed(world, _measure_body)
    for rank, rows in enumerate(per_rank):
        for name, strategy, offload, params, grads, optim, host, n in rows:
            cfg = _config(BENCH, world, strategy, offload)
            est = state_bytes(cfg, world)
            close = pytest.approx  # buckets padded to a multiple of dp, Adam's step counters
            assert est["elements"] == n, (name, rank)
            assert est["params"] == close(params, rel=1e-3), (name, rank)
            assert est["grads"] == close(grads, rel=1e-3), (name, rank)
            if offload is None:
                assert est["optimizer"] == close(optim, rel=1e-3), (name, rank)
                assert est["host"] == host == 0, (name, rank)
            else:   # device bytes + the host's masters and moments (12 of its 16 bytes)
                assert est["optimizer"] + est["host"] * 12 / 16 == close(
                    optim + host * 12 / 16, rel=1e-3), (name, rank)
                assert optim <= est["optimizer"] and host >= est["host"], (name, rank)


def test_peak_holds_the_shard_and_the_buckets_in_flight_under_optim_grads():
    """optim_grads never holds the whole gradient: between steps the shard, during a step
    the shard and the bucket the backward fills (with --overlap-grad-reduce also the one
    being reduce-scattered), each bucket --ddp-bucket-size elements or one larger
    parameter (here the 32000 x 768 word embedding), within the stage's; each
    reduce-scattered once per micro-batch."""
    from megalite.planner.time import estimate_time

    flags = SMALL + ["--micro-batch-size", "1"]
    opt = parse_args(flags + ["--data-parallel-sharding-strategy", "optim"]).validate(8)
    og = parse_args(flags + ["--data-parallel-sharding-strategy", "optim_grads"]).validate(8)
    s_opt, s_og = state_bytes(opt, 8), state_bytes(og, 8)
    assert s_og["grads"] == s_opt["grads"] / 8
    n = s_opt["elements"]
    vocab = og.model.padded_vocab_size(1) * og.model.hidden_size
    assert vocab == 32000 * 768 < 40_000_000 < n     # the default bucket: 40M elements
    assert estimate_memory(og, 8).grads == s_og["grads"] + 4 * 40_000_000
    small = ["--data-parallel-sharding-strategy", "optim_grads", "--ddp-bucket-size", "1000"]
    for extra, held in (([], 1), (["--overlap-grad-reduce"], 2)):
        cfg = parse_args(flags + small + extra).validate(8)
        assert estimate_memory(cfg, 8).grads == s_og["grads"] + held * 4 * vocab
    huge = parse_args(flags + small[:2] + ["--ddp-bucket-size", str(10 * n)]).validate(8)
    assert estimate_memory(huge, 8).grads == s_og["grads"] + 4 * n
    m = og.train.global_batch_size // (8 * og.train.micro_batch_size)
    assert m > 1
    t_opt, t_og = estimate_time(opt, 8, preset("h100", 1)), estimate_time(og, 8,
                                                                            preset("h100", 1))
    grads = 7 / 8 * 4 * n
    assert t_og.comm_bytes["dp"] - t_opt.comm_bytes["dp"] == pytest.approx((m - 1) * grads)
    off = parse_args(flags + ["--use-distributed-optimizer", "--optimizer-cpu-offload",
                              "--optimizer-offload-fraction", "0.25"]).validate(8)
    s_off = state_bytes(off, 8)
    assert s_off["optimizer"] == pytest.approx(s_opt["optimizer"] * 0.75)
    assert s_off["host"] == pytest.approx(s_opt["elements"] * 16 / 8 * 0.25)
    assert estimate_memory(off, 8).total < estimate_memory(opt, 8).total


def test_zero_paper_model_states():
    """ZeRO's Figure 1 (Rajbhandari et al. 2020): a 7.5B model on 64 GPUs with fp16
    parameters and gradients and Adam holds 120 GB of model states per GPU, 31.4 GB with
    the optimizer state sharded (P_os), 16.6 GB with the gradients too (P_os+g): 16, 4.19
    and 2.22 bytes per parameter."""
    flags = ["--num-layers", "36", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--vocab-size",
             "51200", "--global-batch-size", "64", "--micro-batch-size", "1", "--fp16",
             "--grad-reduce-in-bf16", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    want = {"no_shard": 16.0, "optim": 2 + 2 + 12 / 64, "optim_grads": 2 + 14 / 64}
    for strategy, per_param in want.items():
        cfg = parse_args(flags + ["--data-parallel-sharding-strategy", strategy]).validate(64)
        s = state_bytes(cfg, 64)
        assert s["params"] + s["grads"] + s["optimizer"] == pytest.approx(
            per_param * s["elements"], rel=1e-12)
        assert 7.4e9 < s["elements"] < 7.6e9


def test_search_proposes_sharding_strategies_and_offload():
    base = parse_args(SMALL)
    assert {"no_shard", "optim", "optim_grads"} <= set(STRATEGIES)
    tight = Cluster(8, 1, 6 * GIB, 989e12, 450e9, 50e9)
    cands = search(base, tight, micro_batch_sizes=(1,), recomputes=("none",),
                   offloads=(0.0, 1.0))
    names = {c.strategy for c in cands} | {"off" for c in cands if c.offload}
    assert {"no_shard", "optim", "optim_grads", "off"} <= names
    for c in [c for c in cands if c.feasible and (c.offload or c.strategy == "optim_grads")]:
        cfg = parse_args(SMALL + c.launch_flags()).validate(8)
        assert cfg.parallel.data_parallel_sharding_strategy == c.strategy
        assert cfg.optim.optimizer_cpu_offload == bool(c.offload)
    # offload moves optimizer bytes off the device and costs time
    by = {(c.name().replace("+off1", "")): c for c in cands if not c.offload}
    for c in (c for c in cands if c.offload and c.memory):
        twin = by[c.name().replace("+off1", "")]
        assert c.memory.optimizer == 0 and c.memory.host > 0
        assert c.time.step > twin.time.step


def test_offload_timing_uses_the_host_link():
    from dataclasses import replace

    from megalite.planner.time import estimate_time

    flags = SMALL + ["--micro-batch-size", "1", "--use-distributed-optimizer"]
    cfg = parse_args(flags).validate(8)
    off = parse_args(flags + ["--optimizer-cpu-offload"]).validate(8)
    fast = preset("h100")
    slow = replace(fast, host_bw=fast.host_bw / 10)
    assert estimate_time(off, 8, slow).optimizer > estimate_time(off, 8, fast).optimizer \
        > estimate_time(cfg, 8, fast).optimizer
