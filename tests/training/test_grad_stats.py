"""``--log-params-norm`` and ``--log-num-zeros-in-grad``: the parameter norm and the number
of zero gradient elements in the log line / JSONL / TensorBoard.

The one-process run is checked against the model itself (the norm of every parameter
after the last update, the zeros of every gradient of the last step), and each
``grad-stats`` row of ``tests/layouts.py`` (dp with the distributed optimizer, tp + sp,
pp with the tied word embedding on both end stages, ep, tp x pp x distributed optimizer)
against that run: each element counts once whatever the layout, so the norm matches to
fp32 rounding (rel 1e-5) and the count exactly (the zeros are structural: the padded
vocabulary rows of the word embedding).
"""

import os

import pytest
import torch

from tests.layouts import layouts, run_by_world, tiny
from tests.training.common import read_jsonl, run_training, tiny_config

ITERS = 3
ROWS = layouts("grad-stats")
FLAGS = {"log_params_norm": True, "log_num_zeros_in_grad": True}
# no biases: the key part of a QKV bias has a gradient that is zero only in exact
# arithmetic (softmax ignores a shift shared by all keys), so whether its elements come out
# exactly 0 depends on the order of the sums
MODEL = {"add_bias_linear": False}


def _config(lay, tmp):
    path = os.path.join(tmp, f"{lay.name}.jsonl")
    return tiny(lay, model=MODEL, train={"train_iters": ITERS},
                logging={"metrics_jsonl": path, **FLAGS}), path


def _body(rank, world_size, rows, tmp):
    for lay in rows:
        run_training(_config(lay, tmp)[0])
    return [None] * len(rows)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("grad_stats"))


@pytest.fixture(scope="module")
def results(tmp):
    return run_by_world(ROWS, _body, tmp)


@pytest.fixture(scope="module")
def single(tmp):
    """The one-process run of each distinct model, its JSONL rows."""
    out = {}
    for lay in ROWS:
        key = repr(sorted(lay.model.items()))
        if key not in out:
            path = os.path.join(tmp, f"single-{len(out)}.jsonl")
            cfg = tiny_config(model={**MODEL, **lay.model},
                              train={"train_iters": ITERS, **lay.train},
                              logging={"metrics_jsonl": path, **FLAGS})
            out[key] = run_training(cfg), read_jsonl(path)
    return out


def test_one_process_matches_the_model(single, capsys):
    (result, c), rows = single[repr([])]
    params = [p for p in c.model.parameters()]
    want_norm = torch.cat([p.detach().double().flatten() for p in params]).norm().item()
    want_zeros = sum(int((p.main_grad == 0).sum()) for p in params)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    assert rows[-1]["params_norm"] == pytest.approx(want_norm, rel=1e-12)
    assert rows[-1]["num_zeros"] == want_zeros
    assert 0 < want_zeros < sum(p.numel() for p in params)   # unseen / padded vocab rows
    assert rows[0]["params_norm"] != rows[-1]["params_norm"]  # after each update


@pytest.mark.parametrize("lay", ROWS, ids=str)
def test_layout_matches_one_process(lay, results, single, tmp):
    results(lay)
    rows = read_jsonl(os.path.join(tmp, f"{lay.name}.jsonl"))
    (_, _), want = single[repr(sorted(lay.model.items()))]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))   # one writer
    for row, ref in zip(rows, want):
        assert row["params_norm"] == pytest.approx(ref["params_norm"], rel=1e-5)
        assert row["num_zeros"] == ref["num_zeros"]
        assert row["lm_loss"] == pytest.approx(ref["lm_loss"], rel=1e-5)
