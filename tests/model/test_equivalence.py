"""Every TP layout (tp 1/2/4, sequence parallel on/off, recompute none/selective/full)
builds the same model and gives the same loss and full gradients as tp=1.

fp32, dropout 0. Tolerance rtol 1e-5 / atol 1e-6: TP changes only the summation order
of the row-parallel partial sums and the cross-entropy reductions.
"""

import pytest
import torch

from megalite.models.gpt import GPTModel
from megalite.parallel.grads import allreduce_sequence_parallel_grads
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import FAMILIES, batch, single_process_state

RTOL, ATOL = 1e-5, 1e-6
SEED = 11
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full-uniform": {"recompute_granularity": "full", "recompute_method": "uniform",
                         "recompute_num_layers": 2},
    "full-block": {"recompute_granularity": "full", "recompute_method": "block",
                       "recompute_num_layers": 1},
}


def _loss_and_grads(model, cfg, tp_group):
    ids, labels = batch(cfg)
    per_token = model(ids, labels=labels)
    mask = (labels != -100).float()
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    allreduce_sequence_parallel_grads(model.parameters(), tp_group)
    return loss.item(), model.full_grad_dict()


def _compare(got: dict, want: dict) -> list[str]:
    bad = []
    for name, ref in want.items():
        if name not in got or got[name].shape != ref.shape:
            bad.append(f"{name}: shape {getattr(got.get(name), 'shape', None)} vs {ref.shape}")
        elif not torch.allclose(got[name], ref, rtol=RTOL, atol=ATOL):
            bad.append(f"{name}: max diff {(got[name] - ref).abs().max().item():.3g}")
    return bad + [f"unexpected {n}" for n in set(got) - set(want)]


def _run_case(ps, family, recompute, sp, ref):
    cfg = FAMILIES[family](**RECOMPUTE[recompute])
    model = GPTModel(cfg, ps, sequence_parallel=sp, seed=SEED)
    problems = [f"init {p}" for p in _compare(model.full_state_dict(), ref["params"])]
    loss, grads = _loss_and_grads(model, cfg, ps.tp)
    if abs(loss - ref["loss"]) > ATOL + RTOL * abs(ref["loss"]):
        problems.append(f"loss {loss} vs {ref['loss']}")
    return problems + [f"grad {p}" for p in _compare(grads, ref["grads"])]


@pytest.fixture(scope="module")
def references():
    """tp=1, no recompute: full params, loss and full grads per family."""
    refs = {}
    for family, make in FAMILIES.items():
        cfg = make()
        model = GPTModel(cfg, single_process_state(), seed=SEED)
        params = model.full_state_dict()
        loss, grads = _loss_and_grads(model, cfg, model.tp_group)
        refs[family] = {"params": params, "loss": loss, "grads": grads}
    return refs


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("recompute", ["selective", "full-uniform", "full-block"])
def test_recompute_matches_tp1(references, family, recompute):
    problems = _run_case(single_process_state(), family, recompute, False, references[family])
    assert not problems, problems


def _tp_body(rank, world_size, references):
    problems = {}
    for sp in (False, True):
        with parallel_state(tensor_model_parallel_size=world_size, sequence_parallel=sp) as ps:
            for family in FAMILIES:
                for recompute in RECOMPUTE:
                    found = _run_case(ps, family, recompute, sp, references[family])
                    if found:
                        problems[(family, sp, recompute)] = found
    return problems


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_tp1(references, tp):
    for rank, problems in enumerate(run_distributed(tp, _tp_body, references)):
        assert not problems, (rank, problems)
