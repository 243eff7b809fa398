"""fp8 training is layout invariant: the ``fp8`` rows of tests/layouts.py.

Each row trains a tiny GPT with fp8 GEMMs (tensorwise, delayed, mxfp8, blockwise) for 3
iterations on pooled gloo ranks at tp 2 + sequence parallelism, pp 2, dp 2, cp 2 or ep 2,
and compares every rank's losses, grad norms and final parameters with the single-process
fp8 run (the fuzzer's comparison, ``tests/fuzz/check.py``, at its fp32 tolerances): the
amax of a tensor split over tp or cp is reduced over exactly those ranks, and delayed
scaling's history over all ranks of a stage once per step, so the scales are the
one-process run's. An amax left unreduced moves a scale by a factor of up to 2 and the
loss by far more than the tolerance.
"""

import pytest

from tests.fuzz import check
from tests.layouts import layouts

LAYOUTS = layouts("fp8")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout):
    problems, worst = check.check(layout)
    assert not problems, (layout.name, problems[:8], worst)
