"""The layout fuzzer: random compositions of every parallelism and option, each checked
against the single-process run (``tests/fuzz/draw.py`` draws, ``tests/fuzz/check.py``
compares losses and final parameters).

Which seeds run:

* ``make test``: ``DEFAULT_SEEDS``, a few draws that together cover tp with sequence
  parallelism, pp with virtual stages and an uneven stage, MoE with ep / etp and both
  dispatchers, the distributed optimizer with overlap, bf16, and context parallelism;
* ``make fuzz N=200``: ``MEGALITE_FUZZ_N`` seeds from ``MEGALITE_FUZZ_BASE`` on (the
  Makefile prints the base; each test id holds its seed);
* ``MEGALITE_FUZZ_SEED=<seed> make fuzz``: exactly that draw again.

A failure names its seed, the command that reproduces it, and the ``Layout(...)`` row to
paste into ``tests/layouts.py``.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.fuzz.check import check
from tests.fuzz.draw import draw_layout

# on worlds 4 and 8 (the pools other suites use), ~40 s together on 2 cores:
#   5  tp2 x pp2 (ZB-H1) x cp2, MoE ep2 etp1 allgather, multi-latent attention, selective
#      recompute of core_attn, layernorm and mlp, distributed optimizer, bf16, SGD
#  41  tp4 + sp x dp2, sharded gradients, no clipping, fp8 (tensorwise)
#  56  tp2 + sp x pp2 (ZB-H1) with an uneven last stage x dp2, distributed optimizer +
#      overlap, bf16, optimizer offload, a multi-token prediction depth
#  77  tp2 + sp x pp2 x dp2, MoE ep2 etp2 alltoall, distributed optimizer + overlap, bf16,
#      the expert bias, QK norm, --log-max-attention-logit, --moe-shared-expert-overlap
#  93  tp4 + sp x pp2 x vpp2, tied embeddings across stages, QK-clip
# 143  tp2 + sp x cp2 (p2p ring), MoE ep2 etp1 with pre-softmax routing, distributed
#      optimizer + overlap, SGD, split backward (ZB-H1 at pp 1)
# Together they caught each of these planted bugs: a loss normalised by local token
# counts, expert grads reduced over dp instead of edp, the tied embedding's grad not summed
# or summed twice across stages, sequence-parallel norm grads not summed over tp (with
# seed 28 for the uneven stage then; it draws another layout since validation grew).
# test_default_draws_cover_every_parallelism keeps the coverage when draw.py changes.
DEFAULT_SEEDS = (5, 41, 56, 77, 93, 143)


def _seeds() -> list[int]:
    if os.environ.get("MEGALITE_FUZZ_SEED"):
        return [int(os.environ["MEGALITE_FUZZ_SEED"])]
    if os.environ.get("MEGALITE_FUZZ_N"):
        base = int(os.environ.get("MEGALITE_FUZZ_BASE", "0"))
        return [base + i for i in range(int(os.environ["MEGALITE_FUZZ_N"]))]
    return list(DEFAULT_SEEDS)


SEEDS = _seeds()


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_draw_matches_single_process(seed):
    layout = draw_layout(seed)
    start = time.perf_counter()
    problems, (loss_diff, norm_diff, param_diff) = check(layout)
    print(f"\nfuzz seed {seed}: {layout.name} ({time.perf_counter() - start:.1f} s, "
          f"max diff: loss {loss_diff:.2g}, grad norm {norm_diff:.2g} relative, "
          f"params {param_diff:.2g})")
    assert not problems, (
        f"fuzz seed {seed} differs from the single-process run "
        f"(reproduce: MEGALITE_FUZZ_SEED={seed} make fuzz)\n{layout!r}\n"
        + "\n".join(problems[:20]) + (f"\n... {len(problems) - 20} more"
                                      if len(problems) > 20 else ""))


def test_default_draws_cover_every_parallelism():
    """The fixed draws of ``make test`` still compose every parallelism (if draw.py
    changes what a seed draws, pick new ones)."""
    draws = [draw_layout(seed) for seed in DEFAULT_SEEDS]
    covered = set()
    for lay in draws:
        m = lay.model
        covered |= {name for name, on in (
            ("tp+sp", lay.get("tp") > 1 and lay.get("sp")), ("vpp", lay.get("vpp")),
            ("uneven", lay.get("first") or lay.get("last")), ("dp", lay.dp > 1),
            ("ep", lay.get("ep") > 1), ("etp!=tp", lay.get("etp") != lay.get("tp")),
            ("tied pp", lay.get("pp") > 1 and not m.get("untie_embeddings_and_output_weights")),
            ("distopt", lay.get("distopt")), ("overlap", lay.get("overlap_param")),
            ("bf16", m.get("bf16")), ("cp", lay.get("cp") > 1), ("fp8", m.get("fp8_format")),
            ("expert bias", m.get("moe_router_enable_expert_bias")),
            ("zb pp", lay.get("pp") > 1 and lay.get("schedule") == "zb_h1"),
            ("qk-clip", m.get("qk_clip")), ("mtp", m.get("mtp_num_layers")),
            *((f"ep {m.get('moe_token_dispatcher_type')}", lay.get("ep") > 1),)) if on}
    assert covered == {"tp+sp", "vpp", "uneven", "dp", "ep", "etp!=tp", "tied pp", "distopt",
                       "overlap", "bf16", "ep alltoall", "ep allgather", "cp", "fp8",
                       "expert bias", "zb pp", "qk-clip", "mtp"}, covered
    assert all(lay.world_size in (4, 8) for lay in draws)
