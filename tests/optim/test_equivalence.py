"""Layout equivalence of the data-parallel reduction and the distributed optimizer.

Every (layout x optimizer x overlap) run -- the ``optim`` rows of ``tests/layouts.py`` --
trains the tiny GPT (fp32, dropout 0) for 3 iterations with the same global batch as one
process; per-iteration ``lm_loss`` and the final full parameters must match that
single-process run:

- loss: |difference| < 1e-5 (observed ~1e-7: sums over ranks reorder fp32 additions),
  and so for each multi-token prediction depth's logged loss (``mtp_<k>_loss``; the rows
  with ``--mtp-num-layers``, under 1F1B, interleaved, zbv and dualpipev);
- parameters: |difference| < 2e-5 element-wise (observed <= 2e-6 after 3 AdamW steps at
  lr 3e-3).

Layouts: dp 2 and 4, tp 1 and 2 (with sequence parallelism at dp 2), pp 1 and 2, and
pp 2 x vpp 2 (4 layers) at dp 2, each as four rows (plain / distributed optimizer x
overlap off / on; "on" is --overlap-grad-reduce, plus --overlap-param-gather for the
distributed optimizer). Buckets of 3000 elements, so parameters straddle bucket shards.
Each layout also runs ``--data-parallel-sharding-strategy optim_grads`` (gradients
reduce-scattered into a shard of their own, the full buffer freed between steps); dp 2,
tp 2 + sp and pp 2 x vpp 2 also run optim_grads with both overlaps, and
``--optimizer-cpu-offload`` (fraction 0.5 under optim, 1.0 under optim_grads: on this
CPU-only host the offloaded pieces take the same host code path: copies of masters and
gradients, their own torch optimizer). Sharding changes no arithmetic, so these rows
meet the same tolerances. ``optim_grads_params`` (ZeRO-3: parameters sharded too, each
layer gathered around its forward and backward) runs at dp 2, tp 2 + sp and pp 2 x vpp 2;
its rows tagged ``slow`` (dp 4, pp 2, tp 2 x pp 2, both overlaps, tp 2 + sp with all of the
optimizer state offloaded) run in a pool of their own outside the default run.
Not run: dp 4 x tp 2 x pp 2 (a world of 16 on a 2-core machine). The fp32 memory of every
run is checked too: optimizer bytes are 8 per parameter (two Adam moments; the fp32
parameters are the masters), divided by dp under the distributed optimizer; offloaded
elements cost 16 bytes of host memory instead (master copy, gradient copy, moments);
gradient bytes are 4 per parameter, divided by dp under optim_grads.
"""

import pytest

from megalite.optim.memory import expected_optimizer_bytes
from megalite.parallel.state import ParallelState
from tests.layouts import SHORT, layouts, run_by_world
from tests.optim.common import LOSS_TOL, assert_run_matches, config, train_run

LAYOUTS = layouts("optim")
SLOW = [layout for layout in LAYOUTS if "slow" in layout.tags]
# the fields that only choose the optimizer and the overlap: rows differing only in these
# share one ParallelState
_OPTIMIZER_FIELDS = {SHORT[s] for s in ("distopt", "overlap_grad", "overlap_param",
                                         "strategy")}


def _groups_key(layout) -> tuple:
    return tuple(sorted((k, v) for k, v in layout.parallel.items()
                        if k not in _OPTIMIZER_FIELDS))


def _offloaded(c) -> tuple:
    """(dp, (offloaded elements, the largest offloaded piece))."""
    pieces = [pc.hi - pc.lo for pc in getattr(c.optimizer, "pieces", []) if pc.host]
    return c.ps.dp.size, (sum(pieces), max(pieces, default=0))


def _mtp_losses(result) -> dict:
    """iteration -> {mtp_<k>_loss: value} (empty without multi-token prediction)."""
    return {it: {k: v for k, v in extra.items() if k.startswith("mtp_")}
            for it, extra in result.moe_losses.items()}


def _body(rank, world_size, rows):
    out, states = [], {}
    try:
        for layout in rows:
            if _groups_key(layout) not in states:
                base = {k: v for k, v in layout.parallel.items() if k not in _OPTIMIZER_FIELDS}
                cfg = config(world_size, model=layout.model, **base)
                states[_groups_key(layout)] = ParallelState.build(cfg.parallel)
            cfg = config(world_size, model=layout.model, optim=layout.optim, **layout.parallel)
            result, params, memory, (dp, off) = train_run(cfg, inspect=_offloaded,
                                                          ps=states[_groups_key(layout)])
            out.append((result.losses, params, memory, dp, off, _mtp_losses(result)))
    finally:
        for ps in states.values():
            ps.destroy()
    return out


@pytest.fixture(scope="module")
def reference():
    """Single-process losses and full parameters, by model override."""
    refs = {}
    for model in {repr(layout.model): layout.model for layout in LAYOUTS}.values():
        result, params, _, _ = train_run(config(model=model))
        assert result.losses[3] < result.losses[1]
        refs[repr(model)] = (result.losses, params, _mtp_losses(result))
    return refs


@pytest.fixture(scope="module")
def trained():
    """Results by row; the slow rows are trained in pools of their own, so that the default
    run never trains them."""
    default = run_by_world([lay for lay in LAYOUTS if lay not in SLOW], _body)
    slow = run_by_world(SLOW, _body)
    return lambda layout: (slow if layout in SLOW else default)(layout)


@pytest.mark.parametrize("layout", [pytest.param(lay, marks=pytest.mark.slow)
                                    if lay in SLOW else lay for lay in LAYOUTS], ids=str)
def test_matches_single_process(layout, reference, trained):
    ref_losses, ref_params, ref_mtp = reference[repr(layout.model)]
    distributed = layout.get("distopt")
    names = set()
    offload = layout.optim.get("optimizer_offload_fraction", 0.0)
    for losses, params, memory, dp, off, mtp in trained(layout):
        what = f"{layout.name} dp={dp}"
        assert_run_matches(losses, params, ref_losses, ref_params, what)
        assert mtp.keys() == ref_mtp.keys(), what   # the depths' losses (logged means)
        for it, want in ref_mtp.items():
            assert mtp[it].keys() == want.keys() and (
                not layout.model.get("mtp_num_layers") or want), (what, it)
            for key, value in want.items():
                assert abs(mtp[it][key] - value) < LOSS_TOL, (what, it, key, value)
        names.update(params)
        shard = memory.num_params / (dp if distributed else 1)
        off, largest = off   # whole pieces are offloaded, first to last, up to the fraction
        assert offload * shard <= off < offload * shard + largest or off == offload == 0, \
            (what, off, shard)
        want = expected_optimizer_bytes(memory.num_params, dp, distributed, half=False)
        want -= 8 * off
        assert abs(memory.optimizer - want) <= 0.03 * want + 8, (what, memory, want)
        assert abs(memory.offloaded - 16 * off) <= 0.03 * 16 * off, (what, memory, off)
        sharded = layout.get("strategy") in ("optim_grads", "optim_grads_params")
        grads = 4 * memory.num_params / (dp if sharded else 1)
        assert abs(memory.grads - grads) <= 0.03 * grads, (what, memory, grads)
    assert names == set(ref_params), layout.name   # every parameter, on some rank
