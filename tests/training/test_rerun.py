"""--rerun-mode validate_results: suspicious steps re-run once; faults told from bugs."""

from __future__ import annotations

import os

import pytest

from megalite.errors import EXIT_NUMERICAL, EXIT_TRANSIENT_FAULT, exit_code_of
from megalite.training.build import default_model_provider
from megalite.training.rerun import (DeterministicFaultError, ResultValidator,
                                     TransientFaultError)
from tests.training.common import (FaultAtCalls, read_jsonl, run_training, start_two_ranks,
                                   tiny_config, tiny_flags)

ITERS = 6


@pytest.fixture(scope="module")
def clean_losses():
    result, _ = run_training(tiny_config(train={"train_iters": ITERS}))
    return result.losses


def test_a_transient_nan_loss_is_rerun_and_the_curve_is_unchanged(clean_losses, capsys):
    """Call 10 (iteration 3) gives NaN once: the re-run from the same state is clean, and
    every iteration's loss equals the undisturbed run's, bit for bit."""
    provider = lambda c, ps: FaultAtCalls(default_model_provider(c, ps), lambda n: n == 10)
    result, _ = run_training(tiny_config(train={"train_iters": ITERS}),
                             model_provider=provider)
    assert result.losses == clean_losses
    out = capsys.readouterr().out
    assert "iteration 3: transient fault (the loss is nan)" in out
    assert "rank(s) [0]" in out


def test_transient_nan_gradients_are_rerun_too(clean_losses, capsys):
    provider = lambda c, ps: FaultAtCalls(default_model_provider(c, ps), lambda n: n == 6,
                                          grad=True)
    result, _ = run_training(tiny_config(train={"train_iters": ITERS}),
                             model_provider=provider)
    assert result.losses == clean_losses
    assert "iteration 2: transient fault (the gradients hold NaN/inf)" in capsys.readouterr().out


def test_a_persistent_fault_stops_as_deterministic_naming_iteration_and_samples(tmp_path):
    save = str(tmp_path / "ckpt")
    cfg = tiny_config(train={"train_iters": ITERS, "error_injection_rate": 3,
                             "error_injection_type": "persistent_error"},
                      checkpoint={"save": save, "save_interval": 1})
    with pytest.raises(DeterministicFaultError, match=r"iteration 3: the loss is nan, and "
                       r"re-running .* reproduced it.* samples 16\.\.23") as info:
        run_training(cfg)
    assert exit_code_of(info.value) == EXIT_NUMERICAL
    assert sorted(os.listdir(save))[-1] != "iter_0000003"   # nothing saved for it


def test_persistent_nan_gradients_stop_as_deterministic():
    # every call from iteration 2 on (4 micro-batches per iteration)
    provider = lambda c, ps: FaultAtCalls(default_model_provider(c, ps), lambda n: n > 4,
                                          grad=True)
    with pytest.raises(DeterministicFaultError, match="iteration 2: the gradients hold"):
        run_training(tiny_config(train={"train_iters": ITERS}), model_provider=provider)


def test_a_requested_validation_reproduces_every_step_exactly(clean_losses, capsys):
    """--error-injection-type correct_result re-runs steps 2, 4, 6 with nothing injected:
    each re-run must reproduce its step bit for bit (and the curve is unchanged)."""
    result, _ = run_training(tiny_config(train={"train_iters": ITERS, "error_injection_rate": 2,
                                                "error_injection_type": "correct_result"}))
    assert result.losses == clean_losses
    assert capsys.readouterr().out.count("validated: the re-run reproduced") == 3


def test_too_many_transient_faults_stop_with_exit_6():
    cfg = tiny_config(train={"train_iters": ITERS, "error_injection_rate": 1,
                             "rerun_max_transient_faults": 2})
    with pytest.raises(TransientFaultError, match=r"iteration 3: 3 transient faults .* "
                       r"ranks whose results changed on re-run: \[0\]") as info:
        run_training(cfg)
    assert exit_code_of(info.value) == EXIT_TRANSIENT_FAULT == 6


def test_spiky_loss_window():
    v = ResultValidator(mode="validate_results", spiky_factor=3.0)
    for _ in range(9):
        v.accept(2.0)
    assert v.suspicious(100.0, 10) is None          # the window is not full yet
    v.accept(2.0)
    assert v.suspicious(5.9, 11) is None
    assert "over 3x the mean of the last 10 (2" in v.suspicious(6.1, 11)
    assert ResultValidator(mode="disabled").suspicious(float("nan"), 1) is None


def test_two_ranks_name_the_faulty_rank(tmp_path):
    """The fault is injected on the last rank (1) at iteration 3, at tp 2 (rank 0's own
    loss stays finite: the ranks agree to re-run anyway): the log and the metrics file
    name rank 1, and both ranks finish; a persistent fault ends both with exit 5."""
    metrics = tmp_path / "m.jsonl"
    procs = start_two_ranks(tiny_flags(**{"--train-iters": 4, "--error-injection-rate": 3,
                                          "--tensor-model-parallel-size": 2,
                                          "--metrics-jsonl": str(metrics)}))
    outs = [p.communicate(timeout=300) for p in procs]   # (13 s quiet; CI hosts get busy)
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:]
    logged = outs[0][0] + outs[1][0]   # the logging rank prints it
    assert "iteration 3: transient fault (the loss is nan); the re-run differs on rank(s) [1]" \
        in logged
    rows = {r["iteration"]: r for r in read_jsonl(str(metrics)) if "lm_loss" in r}
    assert rows[3]["transient_fault_ranks"] == [1] and "transient_fault_ranks" not in rows[2]
    procs = start_two_ranks(tiny_flags(**{"--train-iters": 4, "--error-injection-rate": 3,
                                          "--error-injection-type": "persistent_error"}))
    outs = [p.communicate(timeout=300) for p in procs]   # (13 s quiet; CI hosts get busy)
    assert [p.returncode for p in procs] == [5, 5]
    assert "megalite: error (rank 0): iteration 3: the loss is nan, and re-running" in outs[0][1]
