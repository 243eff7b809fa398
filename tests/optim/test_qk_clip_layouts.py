"""QK-clip (``--qk-clip``) gives the one-process run at every layout: the ``qk-clip`` rows of
tests/layouts.py (tp 2 + sp, cp 2 ring and all-to-all, pp 2, dp 2 with the distributed
optimizer under AdamW and Muon, ZeRO-3 at tp 2 x dp 2, Muon at cp 2 x dp 2, multi-latent
attention at tp 2 + sp and cp 2, full recomputation at cp 2, bf16 with fp32 masters under
the distributed optimizer) train 3 iterations with a threshold the tiny models pass from
the first step; every rank's losses, the logged grad norm and ``max_attention_logit``
and the final full parameters must match the single-process run at the fuzzer's fp32
tolerances (``tests/fuzz/check.py``; bf16 at its bf16 ones). A maximum not taken over dp,
cp or the micro-batches, a clip of the wrong heads or of the model copy only (not the
distributed optimizer's master pieces) moves these past them: ``test_the_rows_clip``
shows the clip moves the parameters by far more than the tolerance."""

import dataclasses

import pytest

from tests.fuzz import check
from tests.layouts import layouts

LAYOUTS = layouts("qk-clip")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout):
    problems, worst = check.check(layout)
    assert not problems, (layout.name, problems[:8], worst)
    logged = {k for _, _, norms in [check.reference(layout)] for k in norms
              if not isinstance(k, int)}
    assert logged == {("max_attention_logit", it) for it in (1, 2, 3)}, layout.name


def test_the_rows_clip():
    """Each row model's reference, with and without the clip (logging only): the logits of
    the first step pass the threshold, later steps' are below the unclipped run's, and the
    parameters move by far more than the rows' tolerance."""
    seen = set()
    for layout in LAYOUTS:
        ref = check.reference_layout(layout)
        if repr(ref) in seen:
            continue
        seen.add(repr(ref))
        tau = ref.model["qk_clip_threshold"]
        model = {k: v for k, v in ref.model.items() if not k.startswith("qk_clip")}
        plain = dataclasses.replace(ref, model={**model, "log_max_attention_logit": True})
        _, clipped_params, clipped = check.reference(layout)
        _, plain_params, unclipped = check.train_and_gather(plain)
        first = ("max_attention_logit", 1)
        assert clipped[first] == unclipped[first] > 1.2 * tau, layout.name
        for it in (2, 3):
            key = ("max_attention_logit", it)
            assert clipped[key] < unclipped[key], (layout.name, it)
        diff = max((clipped_params[n] - plain_params[n]).abs().max().item()
                   for n in plain_params)
        assert diff > 100 * check.FP32.param_abs, (layout.name, diff)
