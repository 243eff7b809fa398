"""Context parallelism trains the single-process model: the ``cp`` rows of tests/layouts.py.

Each row (cp 2 with each comm type, cp 4 ring, and cp 2 composed with tp 2 + sequence
parallelism, pp 2, pp 2 x vpp 2, dp 2 with the distributed optimizer, ep 2 MoE) trains a
tiny Llama-style GQA model (seq 32, fp32, dropout 0) for 3 iterations on pooled gloo ranks;
every rank's per-iteration ``lm_loss`` and logged ``grad_norm`` and its final full
parameters must match the single-process run (the fuzzer's comparison,
``tests/fuzz/check.py``, with its fp32 tolerances: loss 2e-5, grad norm 1e-4 relative,
parameters 5e-5). A loss normalised per cp rank, gradients not summed over cp, positions
or the causal mask of the wrong chunk each move these far past the tolerances.
"""

import pytest

from tests.fuzz import check
from tests.layouts import layouts

LAYOUTS = layouts("cp")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout):
    problems, worst = check.check(layout)
    assert not problems, (layout.name, problems[:8], worst)
    loss, norm, param = worst
    assert loss < check.FP32.loss_abs and param < check.FP32.param_abs, (layout.name, worst)
