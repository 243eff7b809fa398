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


def _optimizer_memory(rank, world_size, layout):
    from megalite.data.tokenizers import build_tokenizer
    from tests.layouts import tiny
    from tests.optim.common import train_run

    cfg = tiny(layout, train={"train_iters": 1})
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    _, _, memory, shards = train_run(cfg, inspect=lambda c: c.ps.dp_cp.size)
    return memory, shards


def test_distributed_optimizer_shards_over_dp_times_cp():
    """Megatron's layout: the optimizer state is split over dp x cp (4 ranks here), not dp."""
    from megalite.optim.memory import expected_optimizer_bytes
    from tests.distributed.harness import run_distributed
    from tests.layouts import by_name

    layout = by_name("cp-cp2-dp2-distopt-p2p")
    for memory, shards in run_distributed(4, _optimizer_memory, layout):
        assert shards == 4
        want = expected_optimizer_bytes(memory.num_params, 4, True, half=False)
        assert abs(memory.optimizer - want) <= 0.03 * want, (memory, want)
