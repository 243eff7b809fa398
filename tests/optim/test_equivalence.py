"""Layout equivalence of the data-parallel reduction and the distributed optimizer.

Every (layout x optimizer x overlap) run trains the tiny GPT (fp32, dropout 0) for 3
iterations with the same global batch as one process; per-iteration ``lm_loss`` and the
final full parameters must match that single-process run:

- loss: |difference| < 1e-5 (observed ~1e-7: sums over ranks reorder fp32 additions);
- parameters: |difference| < 2e-5 element-wise (observed <= 2e-6 after 3 AdamW steps at
  lr 3e-3).

Layouts: dp 2 and 4, tp 1 and 2 (with sequence parallelism at dp 2), pp 1 and 2, and
pp 2 x vpp 2 (4 layers) at dp 2, each with the four variants of ``VARIANTS`` (plain /
distributed optimizer x overlap off / on; "on" is --overlap-grad-reduce, plus
--overlap-param-gather for the distributed optimizer). Buckets of 3000 elements, so
parameters straddle bucket shards. Not run: dp 4 x tp 2 x pp 2 (a world of 16 on a
2-core machine). The fp32 memory of every run is checked too:
optimizer bytes are 8 per parameter (two Adam moments; the fp32 parameters are the
masters), divided by dp under the distributed optimizer.
"""

import pytest
import torch

from megalite.optim.memory import expected_optimizer_bytes
from megalite.parallel.state import ParallelState
from tests.distributed.harness import run_distributed
from tests.optim.common import VARIANTS, config, train_run

LOSS_TOL = 1e-5
PARAM_TOL = 2e-5
FOUR_LAYERS = {"num_layers": 4}     # pp 2 x vpp 2 needs 4 layers (its own reference)
TP2 = {"tensor_model_parallel_size": 2}
PP2 = {"pipeline_model_parallel_size": 2}
LAYOUTS = {   # world size -> [(parallel, model)]
    2: [({}, None)],
    4: [({}, None), ({**TP2, "sequence_parallel": True}, None), (PP2, None),
        ({**PP2, "virtual_pipeline_model_parallel_size": 2}, FOUR_LAYERS)],
    8: [(TP2, None), ({**TP2, **PP2}, None), (PP2, None)],
}


def _body(rank, world_size, layouts):
    out = []
    for layout, model in layouts:
        ps = ParallelState.build(config(world_size, model=model, **layout).parallel)
        try:
            for variant in VARIANTS:
                cfg = config(world_size, model=model, **layout, **VARIANTS[variant])
                result, params, memory, dp = train_run(cfg, inspect=lambda c: c.ps.dp.size,
                                                       ps=ps)
                out.append((layout, model, variant, result.losses, params, memory, dp))
        finally:
            ps.destroy()
    return out


@pytest.fixture(scope="module")
def reference():
    """Single-process losses and full parameters, by model override."""
    refs = {}
    for model in (None, FOUR_LAYERS):
        result, params, _, _ = train_run(config(model=model))
        assert result.losses[3] < result.losses[1]
        refs[str(model)] = (result.losses, params)
    return refs


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_matches_single_process(world, reference):
    results = run_distributed(world, _body, LAYOUTS[world])
    checked = {}
    for rank_out in results:
        for layout, model, variant, losses, params, memory, dp in rank_out:
            what = f"{layout} {model or ''} {variant} dp={dp}"
            ref_losses, ref_params = reference[str(model)]
            assert list(losses) == list(ref_losses), what
            for it, want in ref_losses.items():
                assert abs(losses[it] - want) < LOSS_TOL, (what, it, losses[it], want)
            for name, tensor in params.items():
                torch.testing.assert_close(tensor, ref_params[name], rtol=0, atol=PARAM_TOL,
                                           msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
            checked.setdefault((str(layout), variant), set()).update(params)
            want = expected_optimizer_bytes(memory.num_params, dp,
                                            "distopt" in variant, half=False)
            assert abs(memory.optimizer - want) <= 0.03 * want, (what, memory, want)
    assert len(checked) == len(LAYOUTS[world]) * len(VARIANTS)
    for (layout, variant), names in checked.items():   # every parameter, on some rank
        model = next(m for lay, m in LAYOUTS[world] if str(lay) == layout)
        assert names == set(reference[str(model)][1]), (layout, variant)
