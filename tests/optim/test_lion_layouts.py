"""Lion's update is the one-process update at every layout: the ``lion`` rows of
``tests/layouts.py`` (tp 2 + sp, pp 2 x vpp 2 with the distributed optimizer and both
overlaps, ZeRO-3 over dp 4, experts over ep 2 with half the state offloaded, and Muon with
``--muon-scalar-optimizer lion`` at tp 2 x dp 2 with the distributed optimizer) train the
tiny Llama-style model of the Muon rows (fp32, dropout 0) for 3 iterations; the losses
and the final full parameters must match the single-process run.

Lion moves every element by ``lr`` times a sign, whatever the gradient's size: an element
whose sign came out otherwise in a layout would be ``2 lr`` (2e-3) away, a hundred times
the parameter tolerance (2e-5), so these rows also check that no sign flipped.
"""

import pytest

from tests.layouts import layouts, run_by_world
from tests.optim.common import (
    assert_ranks_match,
    config,
    single_process_references,
    train_run,
)

LAYOUTS = layouts("lion")


def _body(rank, world_size, rows):
    out = []
    for layout in rows:
        cfg = config(world_size, model=layout.model, optim=layout.optim, **layout.parallel)
        result, params, _, _ = train_run(cfg)
        out.append((result.losses, params))
    return out


@pytest.fixture(scope="module")
def reference():
    return single_process_references(LAYOUTS)


@pytest.fixture(scope="module")
def trained():
    return run_by_world(LAYOUTS, _body)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_lion_matches_single_process(layout, reference, trained):
    assert_ranks_match(layout, trained(layout), reference)
