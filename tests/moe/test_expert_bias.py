"""The expert-bias update is the same for every layout: ep 1 and ep 4, dp 1 and dp 4.

A global batch of ``MICRO`` micro-batches ``[s, b, h]`` goes through one MoE layer
(sigmoid, 8 experts in 4 groups, top-2 of 2 groups, a non-zero starting bias), split the
way training splits it: data-parallel rank ``d`` takes micro-batches ``d, d + dp, ...``,
each cut to its cp chunk (and tp chunk under sequence parallelism). After the forwards,
:func:`update_expert_bias` must leave every rank with the bias (and the load ratios) of
one process that saw the whole batch -- exactly, since the counts are whole numbers.
"""

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.moe.expert_bias import bias_update, load_metrics, reset_expert_load, \
    update_expert_bias
from megalite.moe.layer import MoELayer
from megalite.parallel.state import ParallelState
from tests.distributed.harness import parallel_state, run_distributed

WORLD, MICRO, S, B, H, E = 4, 4, 8, 2, 16, 8
RATE = 0.01
LAYOUTS = {"dp4": {}, "ep4": {"expert_model_parallel_size": 4},
           "tp2-cp2-dp1": {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
           "tp4-sp-ep2-dp1": {"tensor_model_parallel_size": 4, "sequence_parallel": True,
                              "expert_model_parallel_size": 2,
                              "expert_tensor_parallel_size": 1},
           "tp2-sp-ep4-dp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                              "expert_model_parallel_size": 4,
                              "expert_tensor_parallel_size": 1}}


def _cfg():
    return ModelConfig(hidden_size=H, num_layers=2, num_experts=E, moe_router_topk=2,
                       moe_ffn_hidden_size=8, swiglu=True, add_bias_linear=False,
                       moe_router_score_function="sigmoid", moe_router_num_groups=4,
                       moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=RATE, init_method_std=0.3)


def _layer(ps, sp=False):
    layer = MoELayer(_cfg(), ps, layer_number=1, seed=5, sequence_parallel=sp)
    with torch.no_grad():
        layer.router.expert_bias.copy_(
            torch.randn(E, generator=torch.Generator().manual_seed(9)) * 0.05)
    return layer


def _micro(m):
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(50 + m))


def _step(layer, ps, batches):
    reset_expert_load(layer)
    for x in batches:
        layer(x.requires_grad_(True)).sum().backward()
    counts = layer.router.tokens_per_expert.clone()
    ratios = update_expert_bias(layer, ps, RATE, num_layers=2)
    return counts, layer.router.expert_bias.clone(), ratios


def _body(rank, world_size):
    out = {}
    for name, sizes in LAYOUTS.items():
        with parallel_state(**sizes) as ps:
            sp = sizes.get("sequence_parallel", False)
            layer = _layer(ps, sp)
            tp, cp, dp = ps.tp.size, ps.cp.size, ps.dp.size
            batches = []
            for m in range(ps.dp.rank, MICRO, dp):
                x = _micro(m).chunk(cp)[ps.cp.rank]
                batches.append(x.chunk(tp)[ps.tp.rank] if sp else x)
            _, bias, ratios = _step(layer, ps, batches)
            out[name] = (bias, ratios)
    return out


def test_bias_update_is_the_same_at_every_layout():
    ps = ParallelState.build(ParallelConfig())
    counts, want_bias, want_ratios = _step(_layer(ps), ps, [_micro(m) for m in range(MICRO)])
    assert counts.sum() == MICRO * S * B * 2
    start = _layer(ps).router.expert_bias
    torch.testing.assert_close(want_bias - start, bias_update(counts[None], RATE)[0])
    assert set(want_ratios) == {1} and want_ratios[1][0] > 1 > want_ratios[1][1]
    per_rank = run_distributed(WORLD, _body)
    for rank, out in enumerate(per_rank):
        for name in LAYOUTS:
            bias, ratios = out[name]
            assert torch.equal(bias, want_bias), (name, rank, bias - want_bias)
            assert ratios == want_ratios, (name, rank)


def test_bias_update_moves_towards_the_mean_load():
    counts = torch.tensor([[10.0, 2.0, 6.0, 6.0]])
    torch.testing.assert_close(bias_update(counts, 0.5), torch.tensor([[-0.5, 0.5, 0.0, 0.0]]))
    metrics = load_metrics({3: (10 / 6, 2 / 6), 5: (1.5, 0.5)})
    assert metrics["moe_load_max_ratio"] == pytest.approx(10 / 6)
    assert metrics["moe_load_min_ratio"] == pytest.approx(2 / 6)
    assert metrics["expert_load"]["5"] == [1.5, 0.5]
    assert load_metrics({}) == {}


# -- checkpoint: the bias is saved, resharded and resumed exactly -------------------------
SAVE_AT, ITERS = 3, 5


def _train_saving(rank, world_size, layout, checkpoint):
    from tests.layouts import tiny
    from tests.training.common import run_training

    result, c = run_training(tiny(layout, train={"train_iters": ITERS},
                                  checkpoint=checkpoint))
    return result.losses, result.moe_losses, c.model.full_state_dict()


def test_bias_is_checkpointed_and_resumes_at_another_layout(tmp_path):
    """Saved at ep 2 x dp 2 (the ``reshard`` rows), resumed in one process: the losses and
    expert loads of the iterations after the save, and the final bias, are the
    uninterrupted run's (the bias of iteration 3 came back, or the loads would differ);
    a checkpoint holds the bias of its iteration."""
    from megalite.checkpoint.consolidated import load_full_model
    from tests.layouts import by_name, tiny
    from tests.training.common import only_iteration, run_training

    saving, single = by_name("reshard-dp2-ep2-expert-bias"), by_name("reshard-single-expert-bias")
    save = str(tmp_path / "save")
    losses, moe, final = run_distributed(saving.world_size, _train_saving, saving,
                                         {"save": save, "save_interval": SAVE_AT})[0]
    key = "decoder.layers.1.mlp.router.expert_bias"
    assert final[key].abs().sum() > 0 and "decoder.layers.0.mlp.router.expert_bias" not in final
    _, saved = load_full_model(save, ITERS)   # the last save holds the final bias
    assert torch.equal(saved.full_state_dict()[key], final[key])
    _, resumed_from = load_full_model(save, SAVE_AT)   # a bias the resume must restore
    assert resumed_from.full_state_dict()[key].abs().sum() > 0

    load = only_iteration(save, str(tmp_path / "resume"), SAVE_AT)
    result, c = run_training(tiny(single, train={"train_iters": ITERS},
                                  checkpoint={"load": load}))
    for it in range(SAVE_AT + 1, ITERS + 1):
        assert result.losses[it] == pytest.approx(losses[it], rel=2e-6, abs=1e-6), it
        assert result.moe_losses[it]["expert_load"] == moe[it]["expert_load"], it
    assert torch.equal(c.model.full_state_dict()[key], final[key])
