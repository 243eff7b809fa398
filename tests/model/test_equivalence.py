"""Every TP layout (tp 1/2/4, sequence parallel on/off, recompute none/selective/full; the
``model`` rows of ``tests/layouts.py``) builds the same model and gives the same loss and
full gradients as tp=1, for GPT-2 and Llama (GQA); rows that change the model
(multi-latent attention, QK norm) against tp=1 of that model.

fp32, dropout 0. Tolerance rtol 1e-5 / atol 1e-6: TP changes only the summation order
of the row-parallel partial sums and the cross-entropy reductions.
"""

import pytest
import torch

from megalite.models.gpt import GPTModel
from megalite.parallel.grads import allreduce_sequence_parallel_grads
from tests.distributed.harness import parallel_state
from tests.layouts import layouts, run_by_world
from tests.model.common import FAMILIES, batch, single_process_state

RTOL, ATOL = 1e-5, 1e-6
SEED = 11
ROWS = layouts("model")


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


RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers",
                  "recompute_modules")


def _model_key(layout) -> str:
    """The row's model without recomputation (which does not change it)."""
    return repr(sorted((k, v) for k, v in layout.model.items() if k not in RECOMPUTE_KEYS))


def _run_case(ps, family, layout, ref):
    cfg = FAMILIES[family](**layout.model)
    sp = layout.get("sp")
    model = GPTModel(cfg, ps, sequence_parallel=sp, seed=SEED)
    problems = [f"init {p}" for p in _compare(model.full_state_dict(), ref["params"])]
    loss, grads = _loss_and_grads(model, cfg, ps.tp)
    if abs(loss - ref["loss"]) > ATOL + RTOL * abs(ref["loss"]):
        problems.append(f"loss {loss} vs {ref['loss']}")
    return problems + [f"grad {p}" for p in _compare(grads, ref["grads"])]


@pytest.fixture(scope="module")
def references():
    """tp=1, no recompute: full params, loss and full grads per family and row model."""
    refs = {}
    for layout in ROWS:
        key = _model_key(layout)
        if key in refs:
            continue
        model_overrides = {k: v for k, v in layout.model.items() if k not in RECOMPUTE_KEYS}
        refs[key] = {}
        for family, make in FAMILIES.items():
            cfg = make(**model_overrides)
            model = GPTModel(cfg, single_process_state(), seed=SEED)
            params = model.full_state_dict()
            loss, grads = _loss_and_grads(model, cfg, model.tp_group)
            refs[key][family] = {"params": params, "loss": loss, "grads": grads}
    return refs


def _body(rank, world_size, rows, references):
    """Each row's {family: problems} on this rank."""
    out = []
    for layout in rows:
        with parallel_state(**layout.parallel) as ps:
            ref = references[_model_key(layout)]
            out.append({family: _run_case(ps, family, layout, ref[family])
                        for family in FAMILIES})
    return out


@pytest.fixture(scope="module")
def distributed(references):
    return run_by_world([r for r in ROWS if r.world_size > 1], _body, references)


@pytest.mark.parametrize("layout", ROWS, ids=str)
def test_layout_matches_tp1(references, distributed, layout):
    if layout.world_size == 1:
        ref = references[_model_key(layout)]
        ranks = [{family: _run_case(single_process_state(), family, layout, ref[family])
                  for family in FAMILIES}]
    else:
        ranks = distributed(layout)
    for rank, problems in enumerate(ranks):
        assert not any(problems.values()), (layout.name, rank, problems)
