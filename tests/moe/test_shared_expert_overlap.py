"""``--moe-shared-expert-overlap``: the shared experts' forward runs while the dispatch
all-to-all is in flight (:mod:`megalite.moe.shared_overlap`).

* the combinations Megatron-LM refuses are one ConfigError line; the flag without shared
  experts is accepted (and does nothing), as in Megatron-LM;
* :class:`SideJob` computes once, under the grad mode of its creation, also when a
  collective runs it with grad mode off (inside an autograd function's forward);
* on 2 ranks (ep 2, dp 2): training with the flag gives the losses, grad norms and
  parameters of the run without it bit for bit, also under ``--recompute-modules moe``;
  and every shared-expert forward ran between the launch of an asynchronous all-to-all and
  the wait for it (without the flag: no asynchronous all-to-all, the shared experts after).
  The layout-table rows (``moe-training-*-deepseek-sharedov*``) check the same runs
  against one process.
"""

import os

import pytest
import torch

from megalite.config import ConfigError
from megalite.moe.shared_overlap import SideJob
from megalite.parallel import paired_lanes
from tests.distributed.harness import run_distributed
from tests.training.common import read_jsonl, run_training, tiny_config

_MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_shared_expert_intermediate_size": 32,
        "moe_shared_expert_overlap": True}


@pytest.mark.parametrize("model, parallel, match", [
    ({**_MOE, "moe_token_dispatcher_type": "allgather"}, {"expert_model_parallel_size": 2},
     "not --moe-token-dispatcher-type allgather; use alltoall"),
    (_MOE, {"expert_model_parallel_size": 2, "overlap_moe_expert_parallel_comm": True},
     "--overlap-moe-expert-parallel-comm with --moe-shared-expert-overlap is not supported"),
])
def test_refused_as_in_megatron(model, parallel, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(4, model=model, parallel=parallel)


@pytest.mark.parametrize("model", [
    {k: v for k, v in _MOE.items() if k != "moe_shared_expert_intermediate_size"},
    {**_MOE, "moe_token_dispatcher_type": "flex"},
])
def test_accepted(model):
    cfg = tiny_config(4, model=model, parallel={"expert_model_parallel_size": 2})
    assert cfg.model.moe_shared_expert_overlap


def test_side_job_keeps_the_grad_mode_of_its_creation():
    w = torch.ones(3, requires_grad=True)
    calls = []

    def fn():
        calls.append(1)
        return w * 2

    job = SideJob(fn)
    with torch.no_grad():      # as inside an autograd function's forward
        job.run()
        job.run()
    assert job.overlapped and calls == [1]
    job.take().sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))

    with torch.no_grad():
        late = SideJob(fn)
    assert not late.take().requires_grad and not late.overlapped and len(calls) == 2


ITERS = 2
_MODEL = {**_MOE, "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
          "position_embedding_type": "rope", "moe_aux_loss_coeff": 0.01,
          "moe_z_loss_coeff": 0.001}
_RECOMPUTE = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
_VARIANTS = {"plain": {"moe_shared_expert_overlap": False}, "overlap": {},
             "plain-recompute": {"moe_shared_expert_overlap": False, **_RECOMPUTE},
             "overlap-recompute": _RECOMPUTE}


def _record_events(monkeypatch, events):
    """Log ``launch`` / ``wait`` of every asynchronous all-to-all and ``shared`` for every
    shared-expert forward."""
    from megalite.moe import layer
    from megalite.parallel import collectives

    launch, forward = collectives.all_to_all_async, layer.SharedExpertMLP.forward

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            out = self.work.wait()
            events.append("wait")
            return out

    def all_to_all_async(*args, **kwargs):
        out, work = launch(*args, **kwargs)
        events.append("launch")
        return out, Work(work)

    def shared_forward(self, hidden):
        events.append("shared")
        return forward(self, hidden)

    monkeypatch.setattr(collectives, "all_to_all_async", all_to_all_async)
    monkeypatch.setattr(layer.SharedExpertMLP, "forward", shared_forward)


def _train(rank, world_size, directory):
    out = {}
    for name, flags in _VARIANTS.items():
        events = []
        with pytest.MonkeyPatch.context() as mp:
            _record_events(mp, events)
            cfg = tiny_config(world_size, model={**_MODEL, **flags},
                              parallel={"expert_model_parallel_size": 2},
                              train={"train_iters": ITERS},
                              logging={"metrics_jsonl": os.path.join(directory,
                                                                     f"{name}.jsonl")})
            paired_lanes.STATS.reset()
            _, c = run_training(cfg)
        out[name] = ({k: v.clone() for k, v in c.model.state_dict().items()}, events,
                     paired_lanes.STATS.overlapped)
    return out


def test_overlap_is_bitwise_the_plain_run_and_runs_inside_the_dispatch(tmp_path):
    per_rank = run_distributed(2, _train, str(tmp_path), timeout=300)
    rows = {name: read_jsonl(str(tmp_path / f"{name}.jsonl")) for name in _VARIANTS}
    # 2 MoE layers x 2 micro-batches (global 8 / (micro 2 x dp 2)) x ITERS forwards; the
    # recomputed forward runs each layer's experts again in backward
    forwards = 2 * 2 * ITERS
    for rank, out in enumerate(per_rank):
        for name, ref_name in (("overlap", "plain"), ("overlap-recompute", "plain-recompute")):
            params, events, overlapped = out[name]
            ref_params, ref_events, ref_overlapped = out[ref_name]
            runs = forwards * (2 if "recompute" in name else 1)
            # without the flag: no asynchronous all-to-all, the shared experts after
            assert ref_events == ["shared"] * runs and ref_overlapped == 0, (rank, ref_name)
            # with it: each shared-expert forward between a dispatch's launch and its wait
            assert events == ["launch", "shared", "wait"] * runs, (rank, name, events[:6])
            assert overlapped == runs, (rank, name)
            for key, value in ref_params.items():
                assert torch.equal(params[key], value), (rank, name, key)
    for name, ref_name in (("overlap", "plain"), ("overlap-recompute", "plain-recompute")):
        assert len(rows[name]) == ITERS
        for row, ref in zip(rows[name], rows[ref_name]):
            for key in ("lm_loss", "moe_aux_loss", "moe_z_loss", "grad_norm"):
                assert row[key] == ref[key], (name, key, row, ref)
    # and the recomputed runs are those without recomputation
    for row, ref in zip(rows["overlap-recompute"], rows["plain"]):
        assert row["lm_loss"] == ref["lm_loss"]
