"""``--overlap-moe-expert-parallel-comm`` (and ``--delay-wgrad-compute``).

* the turn-taking of :mod:`megalite.parallel.paired_lanes` on one process: the order in
  which two lanes run their segments, exceptions from either lane;
* every combination the flags cannot apply to is one ConfigError line;
* on 2 ranks (ep 2, dp 2, 2 micro-batches per rank) and on 4 (pp 2 x ep 2, pp 2 x vpp 2 x
  ep 2, 4 micro-batches): training with the overlap gives the losses, grad norms and
  parameters of the same layout without it bit for bit (the same operations on the same
  tensors, only interleaved), and exactly the all-to-alls of every steady-state backward
  and its partner forward, on every stage, ran while the other micro-batch computed
  (``paired_lanes.STATS.overlapped``). The layout-table rows
  (``moe-training-dp2-ep2-a2aov*``) check the same runs against one process.
"""

import os

import pytest
import torch

from megalite.config import ConfigError
from megalite.parallel import paired_lanes
from tests.distributed.harness import run_distributed
from tests.training.common import read_jsonl, run_training, tiny_config


class _Done:
    def wait(self):
        return True


def test_lanes_take_turns_at_each_exchange():
    log = []

    def exchange(lane, k):
        log.append(f"{lane}{k}")
        return paired_lanes.exchange(lambda: (torch.zeros(1), _Done()))

    def main():
        for k in range(3):
            exchange("B", k)
        log.append("B-end")

    def side():
        for k in range(2):
            exchange("F", k)
        log.append("F-end")

    paired_lanes.STATS.reset()
    switches = paired_lanes.run_paired(main, side)
    # B issues, F computes to its first exchange, B waits and goes on, ...; once F has
    # finished, B runs to its end without handing over
    assert log == ["B0", "F0", "B1", "F1", "B2", "F-end", "B-end"]
    assert switches == 5   # every exchange handed over: F was still alive at B2
    assert paired_lanes.STATS.calls == 5 and paired_lanes.STATS.overlapped == 5
    assert not paired_lanes.active()
    # outside a pair an exchange waits at once
    paired_lanes.exchange(lambda: (torch.zeros(1), _Done()))
    assert paired_lanes.STATS.overlapped == 5


@pytest.mark.parametrize("grad", [True, False])
def test_side_lane_shares_the_callers_grad_mode(grad):
    """Grad mode is thread-local: the forward on the helper thread runs in the caller's."""
    seen = {}

    def side():
        seen["side"] = torch.is_grad_enabled()

    with torch.set_grad_enabled(grad):
        paired_lanes.run_paired(lambda: None, side)
    assert seen == {"side": grad}


@pytest.mark.parametrize("failing", ["main", "side"])
def test_lane_exception_reaches_the_caller(failing):
    def lane(name):
        def run():
            paired_lanes.exchange(lambda: (torch.zeros(1), _Done()))
            if name == failing:
                raise ValueError(name)
        return run

    with pytest.raises(ValueError, match=failing):
        paired_lanes.run_paired(lane("main"), lane("side"))
    assert not paired_lanes.active()


_MOE = {"num_experts": 4, "moe_router_topk": 2}
_ON = {"overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 2}


@pytest.mark.parametrize("model, parallel, train, match", [
    ({}, {"overlap_moe_expert_parallel_comm": True}, {}, "has none; give --num-experts"),
    (_MOE, {"overlap_moe_expert_parallel_comm": True}, {},
     "--expert-model-parallel-size 1 there is none"),
    ({**_MOE, "moe_token_dispatcher_type": "allgather"}, _ON, {}, "use alltoall"),
    (_MOE, {**_ON, "pipeline_schedule": "zb_h1"}, {}, "--pipeline-schedule zb_h1"),
    ({**_MOE, "num_layers": 4}, {**_ON, "pipeline_model_parallel_size": 2,
                                 "pipeline_schedule": "zbv"}, {}, "--pipeline-schedule zbv"),
    ({**_MOE, "recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1}, _ON, {}, "--recompute-granularity full"),
    ({**_MOE, "recompute_granularity": "selective", "recompute_modules": ["moe"]}, _ON, {},
     "drop moe from --recompute-modules"),
    (_MOE, {**_ON, "data_parallel_sharding_strategy": "optim_grads_params"}, {},
     "use optim_grads or optim"),
    ({**_MOE, "cpu_offloading": True, "cpu_offloading_num_layers": 1}, _ON, {},
     "--cpu-offloading"),
    (_MOE, _ON, {"global_batch_size": 8}, "1 micro-batch per step"),
    (_MOE, {"expert_model_parallel_size": 2, "delay_wgrad_compute": True}, {},
     "give --overlap-moe-expert-parallel-comm too"),
])
def test_refused_where_it_cannot_apply(model, parallel, train, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(4, model=model, parallel=parallel, train=train)


def test_accepted_with_two_microbatches():
    cfg = tiny_config(2, model=_MOE, parallel={**_ON, "delay_wgrad_compute": True})
    assert cfg.parallel.overlap_moe_expert_parallel_comm


ITERS = 2
_MIXTRAL = {**_MOE, "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
            "position_embedding_type": "rope", "moe_aux_loss_coeff": 0.01,
            "moe_z_loss_coeff": 0.001, "moe_shared_expert_intermediate_size": 32}
_VARIANTS = {"plain": {}, "overlap": {"overlap_moe_expert_parallel_comm": True},
             "delay": {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}}


def _train(rank, world_size, directory, model=None, parallel=None, train=None):
    out = {}
    for name, flags in _VARIANTS.items():
        jsonl = os.path.join(directory, f"{name}.jsonl")
        cfg = tiny_config(world_size, model={**_MIXTRAL, **(model or {})},
                          parallel={"expert_model_parallel_size": 2, **(parallel or {}),
                                    **flags},
                          train={"train_iters": ITERS, **(train or {})},
                          logging={"metrics_jsonl": jsonl})
        paired_lanes.STATS.reset()
        _, c = run_training(cfg)
        stats = paired_lanes.STATS
        out[name] = ({k: v.clone() for k, v in c.model.state_dict().items()},
                     stats.calls, stats.overlapped)
    out["pp_rank"] = c.ps.pp.rank
    return out


# (world, model, parallel, train, all-to-alls overlapped per pipeline stage in ITERS steps):
# each pair overlaps all its exchanges (its backward and forward run the same MoE layers,
# dispatch + combine each), and every backward of the steady state pairs on every stage
_LAYOUTS = {
    # ep 2 x dp 2: per step one pair of 2 micro-batches, its 2 MoE layers' 2 + 2 exchanges
    # in each lane
    "ep2": (2, {}, {}, {}, [ITERS * 8]),
    # pp 2 x ep 2 (dp 2), 1F1B at 4 micro-batches, one MoE layer a stage: stage 0 pairs
    # B0-F2, B1-F3; stage 1 B0-F1, B1-F2, B2-F3 (m - 2 and m - 1 pairs; before the plan
    # knew pairs stage 1 paired its warm-up one only), 4 exchanges a pair
    "pp2-ep2": (4, {}, {"pipeline_model_parallel_size": 2}, {"global_batch_size": 16},
                [ITERS * 4 * 2, ITERS * 4 * 3]),
    # interleaved 1F1B over 4 layers (one per chunk and stage), 4 micro-batches (at 2 = pp
    # it runs every forward before any backward: nothing to pair): 2m - 5 = 3 pairs on
    # stage 0 (1 before: the wrap-around's activation came in the backward's round) and
    # 2m - 3 = 5 on stage 1, 4 exchanges a pair
    "pp2-vpp2-ep2": (4, {"num_layers": 4}, {"pipeline_model_parallel_size": 2,
                                            "virtual_pipeline_model_parallel_size": 2},
                     {"global_batch_size": 16}, [ITERS * 4 * 3, ITERS * 4 * 5]),
}


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_overlap_is_bitwise_the_plain_run(tmp_path, layout):
    world, model, parallel, train, per_stage = _LAYOUTS[layout]
    per_rank = run_distributed(world, _train, str(tmp_path), model, parallel, train,
                               timeout=300)
    rows = {name: read_jsonl(str(tmp_path / f"{name}.jsonl")) for name in _VARIANTS}
    for rank, out in enumerate(per_rank):
        plain, calls, overlapped = out["plain"]
        assert calls > 0 and overlapped == 0
        for name in ("overlap", "delay"):
            params, calls_on, overlapped_on = out[name]
            assert calls_on == calls, name   # the same exchanges, ...
            # ... those of each backward paired with the next forward overlapped
            assert overlapped_on == per_stage[out["pp_rank"]], (name, rank, overlapped_on)
            for key, value in plain.items():
                assert torch.equal(params[key], value), (name, rank, key)
    for name in ("overlap", "delay"):
        assert len(rows[name]) == ITERS
        for row, ref in zip(rows[name], rows["plain"]):
            for key in ("lm_loss", "moe_aux_loss", "moe_z_loss", "grad_norm"):
                assert row[key] == ref[key], (name, key, row, ref)
