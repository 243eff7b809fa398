"""Under ZeRO-3 the fp8 copies of a layer's weights live only while its unit is gathered.

The step's quantised weights (:class:`megalite.layers.fp8.scaling.StepWeights`) are kept
through a step under the distributed optimizer, where every rank holds every weight
anyway; ZeRO-3 frees each layer's weights after its forward and backward, and a freed
unit forgets its fp8 copies too, so they never add up to the whole model's (two bytes
per weight element on every rank). Two gloo ranks, a 4-layer fp8 model: the most copies
held at once, counted at every quantisation.
"""

import dataclasses

import pytest

from tests.distributed.harness import run_distributed
from tests.fuzz import check
from tests.layouts import by_name

LAYERS, LINEARS = 4, 4    # qkv, proj, fc1, fc2 per layer


def _held_rank(rank: int, world_size: int, layout):
    """Train ``layout``; the most fp8 linears holding a step copy at one time, and how many
    linears made one."""
    from megalite.layers.fp8.scaling import Fp8Scaling

    seen, most = {}, [0]
    real = Fp8Scaling.weight_fp8

    def counting(self, weight, dtype, record):
        out = real(self, weight, dtype, record)
        if record:
            seen[id(self)] = self
            most[0] = max(most[0], sum(1 for s in seen.values() if "fp8" in s._step))
        return out

    Fp8Scaling.weight_fp8 = counting
    try:
        losses, _, _ = check.train_and_gather(layout)
    finally:
        Fp8Scaling.weight_fp8 = real
    return most[0], len(seen), losses


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("gather", [False, True], ids=["", "fp8-param-gather"])
def test_zero3_holds_the_gathered_layers_copies_only(strategy, gather):
    layout = by_name("fp8-dp2-tensorwise")
    layout = dataclasses.replace(
        layout, model={**layout.model, "num_layers": LAYERS, "fp8_param_gather": gather},
        parallel={**layout.parallel, "use_distributed_optimizer": True,
                  "data_parallel_sharding_strategy": strategy})
    for most, linears, losses in run_distributed(2, _held_rank, layout):
        assert len(losses) == check.ITERS and linears == LAYERS * LINEARS
        if strategy == "optim":
            assert most == LAYERS * LINEARS          # kept through the step
        else:   # the running layer's and, at most, its neighbour's
            assert LINEARS <= most <= 2 * LINEARS, most
