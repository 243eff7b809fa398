"""Delayed fp8 scaling's amax histories in checkpoints: saved, resumed bit for bit at the
same layout, resharded to another layout, and the same at every layout.

A run of 4 iterations with ``--fp8-recipe delayed --fp8-amax-history-len 3
--fp8-amax-compute-algo max`` (scales from the last 3 steps' maxima) against 2 iterations,
a save and 2 more: the resumed losses are bitwise the straight run's only if the
histories come back (empty ones would quantise iteration 3 with scale 1). The tp 2 + sp
and dp 2 runs' histories equal the one-process run's (the amaxes are reduced over tp and
dp), and the tp 2 checkpoint loads into one process with them.
"""

import os

import pytest
import torch

from megalite.checkpoint.state import fp8_histories
from tests.distributed.harness import run_distributed
from tests.layouts import FP8_MODEL, Layout, row, tiny
from tests.training.common import run_training

MODEL = {**FP8_MODEL["delayed"], "fp8_amax_history_len": 3}
TP2 = row("fp8", 2, model=MODEL, tp=2, sp=True)
DP2 = row("fp8", 2, model=MODEL)
SINGLE = Layout("fp8-single", 1, model=MODEL)
ITERS = 4


def _histories(components) -> dict:
    return {k: s.amax_history.clone() for k, s in fp8_histories(components.model)}


def _train(lay: Layout, **train_and_checkpoint):
    checkpoint = train_and_checkpoint.pop("checkpoint", {})
    cfg = tiny(lay, train={"train_iters": ITERS, **train_and_checkpoint},
               checkpoint=checkpoint)
    result, c = run_training(cfg)
    return result.losses, _histories(c)


def _tp2_body(rank, world_size, tmp):
    save = os.path.join(tmp, "tp2")
    straight = _train(TP2)
    first = _train(TP2, exit_interval=ITERS // 2, checkpoint={"save": save})
    second = _train(TP2, checkpoint={"save": save, "load": save})
    return straight, first, second, _train(DP2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fp8ckpt"))
    tp2 = run_distributed(2, _tp2_body, tmp)
    single = _train(SINGLE)
    # the tp2 checkpoint of iteration 2 continued in one process
    resharded = _train(SINGLE, checkpoint={"load": os.path.join(tmp, "tp2"),
                                           "ckpt_step": ITERS // 2})
    return tp2, single, resharded


def test_resume_is_bitwise_with_the_histories(runs):
    tp2, _, _ = runs
    for straight, first, second, _ in tp2:
        assert {**first[0], **second[0]} == straight[0]
        assert list(straight[1]) and list(straight[1]) == list(second[1])
        for key, history in straight[1].items():
            assert torch.equal(history, second[1][key]), key
            assert bool((history > 0).all()), (key, history)   # 3 steps recorded, 4 run


def test_histories_are_the_single_process_ones(runs):
    tp2, single, _ = runs
    straight = tp2[0][0]
    assert set(straight[1]) == set(single[1])
    for rank_run in tp2:   # every tp rank, and every dp rank of dp 2, the same history
        for run in (rank_run[0], rank_run[3]):
            assert set(run[1]) == set(single[1])
            for key, history in run[1].items():
                torch.testing.assert_close(history, single[1][key], rtol=1e-5, atol=0)


def test_a_tp2_checkpoint_resumes_in_one_process(runs):
    tp2, single, resharded = runs
    losses, histories = resharded
    assert list(losses) == [3, 4]
    for it in (3, 4):   # within the fp8 layout tolerance of tests/fuzz/check.py
        assert abs(losses[it] - single[0][it]) < 1e-4, (it, losses, single[0])
    for key, history in histories.items():
        torch.testing.assert_close(history, single[1][key], rtol=1e-5, atol=0)
