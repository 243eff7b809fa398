"""Muon's update is the one-process update at every layout: the ``muon`` rows of
``tests/layouts.py`` (tp 2 + sp in both tp modes, pp 2 x vpp 2, dp 4 plain and under each
sharding strategy, tp 2 x dp 2 with the owner exchange, experts over edp 2 and over etp 2,
half the optimizer state offloaded) train a tiny Llama-style GQA model (fp32, dropout 0)
for 3 iterations with ``--optimizer muon --muon-nesterov``; the losses and the final full
parameters must match the single-process Muon run.

Tolerances: those of the AdamW rows, loss 1e-5 and parameters 2e-5 (observed <= 1.3e-7:
the Newton-Schulz iteration of a matrix whose gradient was summed in another order, or
whose Gram matrices are summed over tp shards in the distributed mode, differs by float
rounding). ``--muon-tp-mode blockwise``
is left out on purpose: each tp shard orthogonalised apart is another update
(``test_blockwise_depends_on_tp`` shows the rows would catch it). Under a sharding
strategy each matrix is owned by exactly one rank of its gradient group: summed over the
ranks, the elements owned times the group's size are all the Muon elements.
"""

import pytest

from tests.layouts import MUON, MUON_MODEL, layouts, row, run_by_world
from tests.optim.common import (
    PARAM_TOL,
    assert_ranks_match,
    config,
    reference_key,
    single_process_references,
    train_run,
)

LAYOUTS = layouts("muon")


def _owned(c):
    exchange = getattr(c.optimizer, "exchange", None)
    return exchange.owned() if exchange is not None else None


def _body(rank, world_size, rows):
    out = []
    for layout in rows:
        cfg = config(world_size, model=layout.model, optim=layout.optim, **layout.parallel)
        result, params, memory, owned = train_run(cfg, inspect=_owned)
        out.append((result.losses, params, owned))
    return out


@pytest.fixture(scope="module")
def reference():
    return single_process_references(LAYOUTS)


@pytest.fixture(scope="module")
def trained():
    return run_by_world(LAYOUTS, _body)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_muon_matches_single_process(layout, reference, trained):
    runs = trained(layout)
    assert_ranks_match(layout, [(losses, params) for losses, params, _ in runs], reference)
    owned = [o for _, _, o in runs]
    sharded = layout.get("distopt") or layout.get("strategy") != "no_shard"
    assert (owned[0] is not None) == bool(sharded), layout.name
    if owned[0] is not None:   # each matrix gathered on one rank of its group, not on all
        for group in owned[0]:
            mine = sum(o[group][0] for o in owned)
            total = sum(o[group][1] for o in owned)
            assert mine * owned[0][group][2] == total > 0, (layout.name, group)


def test_blockwise_depends_on_tp(reference):
    """--muon-tp-mode blockwise (each tp shard orthogonalised apart, Megatron-LM's default)
    is another update at tp 2: these rows' tolerance would catch it."""
    lay = row("muon", 2, "blockwise", model=MUON_MODEL,
              optim={**MUON, "muon_tp_mode": "blockwise"}, tp=2, sp=True)
    (losses, params, _), _ = run_by_world([lay], _body)(lay)
    ref_losses, ref_params = reference[reference_key(lay)]
    diff = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    assert diff > 20 * PARAM_TOL, diff
