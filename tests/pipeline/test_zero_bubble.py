"""Zero-bubble schedules (``megalite.pipeline.zero_bubble``): step lists complete and in
dependency order, transfers matched by order alone (NCCL), ZB-H1's memory and bubble
against its theory, W steps that carry the weight gradients, and the flag's bad inputs.
The training equivalence is in the ``pipeline`` rows of ``tests/layouts.py``."""

import itertools

import pytest

from megalite.config import ConfigError
from megalite.models.gpt import GPTModel
from megalite.parallel import weight_grad
from megalite.pipeline.plan import plan_rounds
from megalite.pipeline.schedules import build_schedule, build_schedules, run_schedule
from megalite.pipeline.zero_bubble import simulate, zb_h1
from tests.distributed.harness import parallel_state
from tests.model.common import batch, gpt2_config
from tests.pipeline.test_pipeline_schedules import _batches, nccl_matching
from tests.training.common import tiny_config

ZB_CASES = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 12, 16]))


def _in_flight(steps):
    """Peak number of micro-batches whose forward ran and whose W did not."""
    live = peak = 0
    for kind, _, _ in steps:
        live += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p, m", ZB_CASES)
def test_zb_h1_is_complete_ordered_and_nccl_matched(p, m):
    schedules = build_schedules(p, m, schedule="zb_h1")
    for r, steps in enumerate(schedules):
        assert steps == zb_h1(p, r, m)
        for kind in "FBW":
            assert sorted(s[2] for s in steps if s[0] == kind) == list(range(m))
        for mb in range(m):
            assert steps.index(("F", 0, mb)) < steps.index(("B", 0, mb)) \
                < steps.index(("W", 0, mb))
        # 1F1B's activation memory: at most p micro-batches in flight (rank 0's 1F1B peak)
        assert _in_flight(steps) <= min(p, m)
    rounds = plan_rounds(schedules, 1)
    for r in range(p):
        assert [x.step for x in rounds[r] if x.step] == schedules[r]
        assert not any(x.sends for x in rounds[r] if x.step and x.step[0] == "W")
    nccl_matching([_batches(rounds[r], r, p, 1) for r in range(p)])


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    """Equal F, B and W times: ZB-H1's bubble (p - 1) / (3 m) against 1F1B's (p - 1) / m
    (the simulator gives 1F1B's formula exactly)."""
    total_1f1b, idle_1f1b = simulate(build_schedules(p, m), forward=1, backward=2)
    total_zb, idle_zb = simulate(build_schedules(p, m, schedule="zb_h1"), forward=1,
                                 backward=2, weight=1)
    assert total_1f1b == 3 * (m + p - 1)
    assert sum(idle_1f1b) / p == pytest.approx((p - 1) / m)
    assert sum(idle_zb) / p == pytest.approx((p - 1) / (3 * m))
    assert total_zb == 3 * m + p - 1


def test_simulate_interleaved_matches_megatron_bubble():
    p, v, m = 4, 2, 8
    _, idle = simulate(build_schedules(p, m, v), v, forward=1 / v, backward=2 / v)
    assert sum(idle) / p == pytest.approx((p - 1) / (v * m))


def test_w_steps_carry_the_weight_gradients(monkeypatch):
    """One stage, ZB-H1 (F B W per micro-batch): every W step applies the deferred
    gradients of every weight GEMM (and the word embedding's table)."""
    applied = []
    real_apply = weight_grad.apply

    def recording_apply(queue):
        applied.append(len({id(item.weight) for item in queue}))
        real_apply(queue)

    monkeypatch.setattr(weight_grad, "apply", recording_apply)
    cfg = gpt2_config()
    with parallel_state() as ps:
        model = GPTModel(cfg, ps, seed=1)
        fc1 = model.decoder.layers["0"].mlp.linear_fc1.weight
        seen = []

        def forward_step(chunk, mb, x):
            seen.append(fc1.grad is None)
            ids, labels = batch(cfg, seed=mb)
            return model(ids, labels=labels).sum()

        steps = [zb_h1(1, 0, 2)]
        assert steps[0] == [("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 0, 1),
                            ("B", 0, 1), ("W", 0, 1)]
        run_schedule(steps, forward_step=forward_step, ps=ps, vpp=1, comm=None)
    assert seen == [True, False]            # after F0 B0 W0 the gradient is there
    # the linear layers' weights and the word embedding (its lookup and, tied, the
    # output layer); the norms and the learned position embedding get theirs in B
    deferred = sum(1 for n, _ in model.named_parameters()
                   if n.endswith("weight") and "norm" not in n and "position" not in n)
    assert applied == [deferred, deferred]


def test_flag_values_and_their_errors():
    cfg = tiny_config(2, parallel={"pipeline_model_parallel_size": 2,
                                   "pipeline_schedule": "zb_h1"})
    assert cfg.resolve(2).pipeline_schedule == "zb_h1"
    assert tiny_config(2, parallel={"pipeline_model_parallel_size": 2}).resolve(
        2).pipeline_schedule == "1f1b"
    with pytest.raises(ConfigError, match="zb_h1 runs one model chunk per pipeline rank"):
        tiny_config(2, parallel={"pipeline_model_parallel_size": 2,
                                 "virtual_pipeline_model_parallel_size": 2,
                                 "pipeline_schedule": "zb_h1"}).resolve(2)
    with pytest.raises(ConfigError, match="interleaved_1f1b runs several model chunks"):
        tiny_config(2, parallel={"pipeline_model_parallel_size": 2,
                                 "pipeline_schedule": "interleaved_1f1b"}).resolve(2)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'gpipe'"):
        build_schedule(2, 0, 4, schedule="gpipe")
