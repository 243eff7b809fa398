"""The planner under ``--optimizer muon`` (:mod:`megalite.planner.muon`): the Newton-Schulz
FLOPs of the matrices Muon orthogonalises, counted from the config, equal those of the
model megalite builds; each rank's share follows ``--muon-tp-mode`` and the distributed
optimizer's owners; the iteration's rate follows ``--muon-fp32-matmul-prec``; the step time
carries it; the optimizer state (momentum for the matrices, Adam's two moments for the
rest) equals what the ranks hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megalite.arguments import parse_args
from megalite.config import OptimConfig
from megalite.config.layout import resolve_layout
from megalite.models.gpt import GPTModel
from megalite.optim.algorithms.muon import is_matrix
from megalite.optim.muon_layout import matrices
from megalite.planner import muon
from megalite.planner.cluster import preset
from megalite.planner.memory import state_bytes
from megalite.planner.time import estimate_time
from tests.model.common import (deepseek_v3_config, gpt2_config, llama_config,
                                mixtral_config, single_process_state)

STEPS = 5
MODELS = {
    "llama": llama_config,
    "gpt2": gpt2_config,
    "mixtral": mixtral_config,
    "deepseek-v3-mtp": lambda: deepseek_v3_config(mtp_num_layers=1),
    "deepseek-v3-no-q-lora": lambda: deepseek_v3_config(q_lora_rank=None),
}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("family", MODELS)
def test_config_matrices_are_the_models(family, split):
    """Every matrix Muon orthogonalises in the model megalite builds (tp 1), by shape and
    Newton-Schulz FLOPs, is the one the planner counts from the config."""
    cfg = MODELS[family]()
    ocfg = OptimConfig(optimizer="muon", muon_split_qkv=split)
    model = GPTModel(cfg, single_process_state(), seed=1)
    built = matrices([(n, p) for n, p in model.named_parameters() if is_matrix(n, p)],
                     single_process_state(), ocfg)
    counted = [mat for layer in range(cfg.num_layers)
               for mat in muon.layer_matrices(cfg, layer, split)] + muon.mtp_matrices(cfg, split)
    assert sum(mat.flops(STEPS) for mat in counted) == sum(m.cost(STEPS) for m in built)
    assert sum(mat.count * mat.rows * mat.cols for mat in counted) == \
        sum(m.param.numel() for m in built)

    def shapes(m):
        full = m.full_shape()
        count = full[0] if m.expert else 1
        return [(count, rows, full[-1]) for rows in (m.parts or (full[-2],))]

    assert sorted((mat.count, mat.rows, mat.cols) for mat in counted) == \
        sorted(s for m in built for s in shapes(m))


BASE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "2816",
        "--swiglu", "--seq-length", "2048", "--max-position-embeddings", "2048",
        "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--bf16", "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--optimizer", "muon"]


def _cfg(*extra, world=1):
    cfg = parse_args(BASE + list(extra)).validate(world)
    return cfg, resolve_layout(cfg, world)


def _flops(*extra, world=1):
    return muon.step_flops(*_cfg(*extra, world=world))


def test_each_ranks_share_follows_the_layout():
    whole = _flops()
    h, f, n, g, d = 1024, 2816, 16, 4, 64
    per_layer = sum(muon.ns_flops(r, c, STEPS) for r, c in
                    [(n * d, h), (g * d, h), (g * d, h), (h, n * d), (2 * f, h), (h, f)])
    assert whole == 8 * per_layer
    # every replica iterates every matrix; the distributed optimizer's owners share them
    assert _flops(world=2) == whole
    assert _flops("--use-distributed-optimizer", world=2) == pytest.approx(whole / 2)
    assert _flops("--use-distributed-optimizer", world=4) == pytest.approx(whole / 4)
    # pp 2: each stage its four layers
    assert _flops("--pipeline-model-parallel-size", "2", world=2) == pytest.approx(whole / 2)
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    # duplicated: each whole matrix on one owner of the tp group
    assert _flops(*tp2, world=2) == pytest.approx(whole / 2)
    # distributed: every rank its half of the split side, the Gram side whole
    distributed = _flops(*tp2, "--muon-tp-mode", "distributed", world=2)
    kept = [(h, n * d), (h, g * d), (h, g * d), (h, n * d), (h, 2 * f), (h, f)]
    assert distributed == pytest.approx(8 * sum(
        STEPS * (4.0 * m * m * c / 2 + 2.0 * m ** 3) for m, c in kept))
    assert whole / 2 < distributed < whole
    # blockwise: each shard on its own
    blockwise = _flops(*tp2, "--muon-tp-mode", "blockwise", world=2)
    assert blockwise == pytest.approx(8 * sum(muon.ns_flops(r, c, STEPS) for r, c in
        [(n * d // 2, h), (g * d // 2, h), (g * d // 2, h), (h, n * d // 2),
         (f, h), (h, f // 2)]))
    # a rank never does less than the largest matrix it owns
    assert _flops("--use-distributed-optimizer", "--global-batch-size", "64", world=64) == \
        muon.ns_flops(2 * f, h, STEPS)


def test_experts_are_shared_over_their_own_groups():
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512"]
    one = _flops(*moe)
    ep2 = _flops(*moe, "--expert-model-parallel-size", "2", world=2)
    experts = 8 * 8 * (muon.ns_flops(1024, 2 * 512, STEPS) + muon.ns_flops(512, 1024, STEPS))
    # ep 2 holds half the experts; dense matrices stay whole on every replica
    assert one - ep2 == pytest.approx(experts / 2)


def test_precision_sets_the_rate_and_muon_shows_in_the_step():
    cfg, _ = _cfg()
    h100 = preset("h100", 1)
    assert muon.iteration_rate("high", h100) * 2 == muon.iteration_rate("medium", h100) \
        == muon.iteration_rate("low", h100) == h100.peak_flops * h100.matmul_efficiency
    cpu = replace(h100, fp32_flops=0.0)       # a CPU cluster: IEEE fp32 at every setting
    assert muon.iteration_rate("high", cpu) == muon.iteration_rate("medium", cpu)
    adam = estimate_time(parse_args([a for a in BASE if a not in ("--optimizer", "muon")]
                                    ).validate(1), 1, h100)
    medium = estimate_time(cfg, 1, h100)
    high = estimate_time(_cfg("--muon-fp32-matmul-prec", "high")[0], 1, h100)
    ns = _flops() / muon.iteration_rate("medium", h100)
    # the matrices' element-wise passes: 62 bytes an element (no Nesterov, bf16) where
    # every parameter is charged 16 + 2 x 2
    h, f, n, g, d = 1024, 2816, 16, 4, 64
    elements = 8 * (h * (n + 2 * g) * d + n * d * h + 3 * f * h)
    assert muon.elementwise_bytes(False, 2) == 62 and muon.elementwise_bytes(True, 2) == 74
    passes = elements * (62 - 20) / h100.memory_rate
    assert medium.optimizer - adam.optimizer == pytest.approx(ns + passes, rel=1e-9)
    assert high.optimizer - adam.optimizer == pytest.approx(2 * ns + passes, rel=1e-9)
    assert medium.step - adam.step == pytest.approx(ns + passes, rel=1e-9)
    nesterov = estimate_time(_cfg("--muon-nesterov")[0], 1, h100)
    assert nesterov.optimizer - medium.optimizer == pytest.approx(
        elements * 12 / h100.memory_rate, rel=1e-9)


def test_elementwise_passes_are_divided_over_the_owners_and_tp():
    """Each rank steps its tp shard of the matrices, and under the distributed optimizer
    its 1/dp of them: the element count halves with each."""
    h, f, n, g, d = 1024, 2816, 16, 4, 64
    elements = 8 * (h * (n + 2 * g) * d + n * d * h + 3 * f * h)
    assert muon.elementwise_elements(*_cfg()) == elements
    assert muon.elementwise_elements(*_cfg("--use-distributed-optimizer", world=2)) \
        == elements / 2
    assert muon.elementwise_elements(*_cfg(world=2)) == elements      # dp2, replicated
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert muon.elementwise_elements(*_cfg(*tp2, world=2)) == elements / 2
    assert muon.elementwise_elements(*_cfg(*tp2, "--use-distributed-optimizer",
                                           world=4)) == elements / 4


def test_exchange_bytes():
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    h, f, n, g, d = 1024, 2816, 16, 4, 64
    elements = 8 * (h * (n + 2 * g) * d + n * d * h + 3 * f * h)
    cfg, lay = _cfg(*tp2, world=2)
    assert muon.step_bytes(cfg, lay) == (pytest.approx(2 * 4 * elements / 2 / 2), 0.0)
    cfg, lay = _cfg(*tp2, "--use-distributed-optimizer", world=4)
    tp_bytes, dp_bytes = muon.step_bytes(cfg, lay)
    assert tp_bytes == pytest.approx(2 * 4 * elements / 2 / 2 / 2)
    assert dp_bytes == pytest.approx(2 * 4 * elements / 2 * (2 - 1) / 2 ** 2)
    cfg, lay = _cfg(*tp2, "--muon-tp-mode", "distributed", world=2)
    kept = [h] * 6      # the unsplit side of q, k, v, proj, fc1, fc2
    assert muon.step_bytes(cfg, lay)[0] == pytest.approx(
        8 * STEPS * sum(2 * 4 * k * k / 2 for k in kept))
    assert muon.step_bytes(*_cfg(*tp2, "--muon-tp-mode", "blockwise", world=2)) == (0.0, 0.0)


def _measure_muon_state(rank, world, optimizer="muon"):
    import torch
    from types import SimpleNamespace

    from tools.bench.memory import _config, _runs, measure

    torch.set_num_threads(1)
    bench = SimpleNamespace(num_layers=2, hidden_size=64, vocab_size=256,
                            tensor_model_parallel_size=1, grad_reduce_in_bf16=False,
                            optimizer_offload_fraction=None, optimizer=optimizer)
    rows = []
    for run in _runs(bench):
        name, strategy, _, mem = measure(bench, world, run)[:4]
        rows.append((name, mem.optimizer, state_bytes(_config(bench, world, strategy, None),
                                                      world)["optimizer"]))
    return rows


@pytest.mark.parametrize("optimizer", ["muon", "lion"])
@pytest.mark.parametrize("world", [1, 2])
def test_muon_state_bytes_equal_the_measured_rank_memory(world, optimizer):
    """bf16 GPT, every sharding strategy: the fp32 masters, the matrices' momentum (Lion:
    its exp_avg) and the other parameters' two Adam moments (21% of the elements here) as
    the ranks hold them; within Adam's step counters on one rank, the mean of the two
    ranks' shards at dp 2 (each rank's split of matrices and the rest follows the bucket
    layout: 3% apart)."""
    from tests.distributed.harness import run_distributed

    per_rank = run_distributed(world, _measure_muon_state, optimizer)
    for rows in zip(*per_rank):
        assert len({name for name, *_ in rows}) == 1
        measured = sum(optim for _, optim, _ in rows) / world
        estimate = rows[0][2]
        assert estimate == pytest.approx(measured, rel=1e-3), rows
        for _, optim, _ in rows:
            assert optim == pytest.approx(estimate, rel=0.04), rows
