"""Model-parallel RNG: replicated regions draw identical masks, TP regions distinct ones,
and recomputation replays the same masks."""

import torch

from megalite.models.gpt import GPTModel
from megalite.parallel.grads import allreduce_sequence_parallel_grads
from megalite.parallel.random import REPLICATED, TENSOR_PARALLEL, RNGTracker
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import FAMILIES, batch, single_process_state

DROPOUT = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
RECOMPUTE = [{"recompute_granularity": "selective"},
             {"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1}]


def _grads(ps, cfg, sp, seed=5):
    model = GPTModel(cfg, ps, sequence_parallel=sp, seed=seed)
    ids, labels = batch(cfg)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    allreduce_sequence_parallel_grads(model.parameters(), ps.tp)
    return loss.item(), model.full_grad_dict()


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _body(rank, world_size):
    out = {}
    with parallel_state(tensor_model_parallel_size=world_size) as ps:
        tracker = RNGTracker.from_state(ps, seed=3)
        before = torch.get_rng_state()
        with tracker.fork(REPLICATED):
            out["replicated"] = torch.rand(8)
        with tracker.fork(TENSOR_PARALLEL):
            out["tensor_parallel"] = torch.rand(8)
        out["global_untouched"] = torch.equal(before, torch.get_rng_state())
    for sp in (False, True):
        with parallel_state(tensor_model_parallel_size=world_size, sequence_parallel=sp) as ps:
            for family, make in FAMILIES.items():
                loss, ref = _grads(ps, make(**DROPOUT), sp)
                # replicated params see identical activations on every TP rank only if
                # the replicated-region masks agree
                out[(family, sp, "norm_grad")] = ref["decoder.final_layernorm.weight"]
                out[(family, sp, "dropout_changes_loss")] = abs(
                    loss - _grads(ps, make(), sp)[0])
                out[(family, sp, "recompute")] = max(
                    _max_diff(_grads(ps, make(**DROPOUT, **r), sp)[1], ref) for r in RECOMPUTE)
    return out


def test_dropout_streams_and_recompute_on_two_ranks():
    r0, r1 = run_distributed(2, _body)
    assert torch.equal(r0["replicated"], r1["replicated"])
    assert not torch.equal(r0["tensor_parallel"], r1["tensor_parallel"])
    assert r0["global_untouched"] and r1["global_untouched"]
    for family in FAMILIES:
        for sp in (False, True):
            if not sp:  # under SP the hidden states differ per rank by construction
                assert torch.equal(r0[(family, sp, "norm_grad")], r1[(family, sp, "norm_grad")])
            assert r0[(family, sp, "dropout_changes_loss")] > 1e-6
            assert r0[(family, sp, "recompute")] < 1e-6, (family, sp)


def test_recompute_replays_dropout_single_process():
    ps = single_process_state()
    for make in FAMILIES.values():
        _, ref = _grads(ps, make(**DROPOUT), False)
        for r in RECOMPUTE:
            assert _max_diff(_grads(ps, make(**DROPOUT, **r), False)[1], ref) < 1e-6


def test_eval_mode_is_deterministic():
    ps = single_process_state()
    cfg = FAMILIES["gpt2"](**DROPOUT)
    model = GPTModel(cfg, ps, seed=5).eval()
    ids, _ = batch(cfg)
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))
