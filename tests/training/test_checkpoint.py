"""Checkpoint format, crash safety, mismatch errors, load options, exits and NaN stops."""

import json
import os

import pytest
import torch

from megalite.checkpoint import CheckpointError, load_checkpoint, read_latest_iteration
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components, default_model_provider
from megalite.training.loop import NonFiniteLossError
from tests.training.common import FaultAtCalls, run_training, tiny_config


def _build(cfg):
    ps = ParallelState.build(cfg.parallel)
    return build_components(cfg, ps, peak_probe_seconds=0.01)


def test_layout_on_disk_and_round_trip(tmp_path):
    save = str(tmp_path / "ckpt")
    cfg = tiny_config(train={"train_iters": 4}, checkpoint={"save": save, "save_interval": 2})
    result, trained = run_training(cfg)
    assert result.exit_reason == "finished" and read_latest_iteration(save) == 4
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]
    it4 = os.path.join(save, "iter_0000004")
    assert sorted(os.listdir(it4)) == [".metadata", "__0_0.distcp", "metadata.json"]
    with open(os.path.join(it4, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["iteration"] == 4 and meta["consumed_samples"] == 32
    assert meta["layout"]["tp"] == 1 and meta["config"]["model"]["hidden_size"] == 32
    assert meta["optimizer_state"] == ["exp_avg", "exp_avg_sq"] and meta["rng"] is True

    c = _build(tiny_config(checkpoint={"load": save}))
    assert (c.state.iteration, c.state.consumed_train_samples) == (4, 32)
    assert c.scheduler.num_steps == 4
    for (name, p), q in zip(c.model.named_parameters(), trained.model.parameters()):
        assert torch.equal(p, q), name
    assert len(c.optimizer.inner.state) == len(list(c.model.parameters()))
    c.close()


def test_load_options_finetune_no_optim(tmp_path):
    save = str(tmp_path / "ckpt")
    _, trained = run_training(tiny_config(train={"train_iters": 2},
                                          checkpoint={"save": save}))
    c = _build(tiny_config(checkpoint={"load": save, "finetune": True}))
    assert c.state.iteration == 0 and c.state.consumed_train_samples == 0
    assert c.scheduler.num_steps == 0 and c.optimizer.num_steps == 0
    assert torch.equal(next(c.model.parameters()), next(trained.model.parameters()))
    c.close()
    c = _build(tiny_config(checkpoint={"load": save, "no_load_optim": True, "no_load_rng": True}))
    assert c.state.iteration == 2 and c.optimizer.num_steps == 0
    c.close()
    empty = str(tmp_path / "empty")     # --load without --save expects a checkpoint
    with pytest.raises(CheckpointError, match="expects a checkpoint"):
        _build(tiny_config(checkpoint={"load": empty}))
    assert _build(tiny_config(checkpoint={"load": empty, "save": empty})).state.iteration == 0


def test_shape_mismatch_names_first_tensor(tmp_path):
    save = str(tmp_path / "ckpt")
    run_training(tiny_config(train={"train_iters": 1}, checkpoint={"save": save}))
    cfg = tiny_config(model={"ffn_hidden_size": 64})
    cfg.model.vocab_size = 61  # as the NullTokenizer sets it
    ps = ParallelState.build(cfg.parallel)
    model = default_model_provider(cfg, ps)
    with pytest.raises(CheckpointError, match=r"tensor 'decoder\.layers\.0\.mlp\.\S+' has "
                                              r"shape \(128, 32\) in checkpoint .* but "
                                              r"\(64, 32\) in the model"):
        load_checkpoint(save, model, None, None, ps)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        load_checkpoint(save, model, None, None, ps)


def test_nan_loss_stops_naming_iteration_without_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    cfg = tiny_config(train={"train_iters": 6, "rerun_mode": "disabled"},
                      checkpoint={"save": save, "save_interval": 1})
    # 4 micro-batches per iteration: call 10 is in iteration 3 (without --rerun-mode
    # validate_results: tests/training/test_rerun.py re-runs it)
    provider = lambda c, ps: FaultAtCalls(default_model_provider(c, ps), lambda n: n == 10)
    with pytest.raises(NonFiniteLossError, match="loss is nan at iteration 3"):
        run_training(cfg, model_provider=provider)
    assert read_latest_iteration(save) == 2
    assert "iter_0000003" not in os.listdir(save)


def test_exit_interval_and_duration_save_and_stop(tmp_path):
    save = str(tmp_path / "a")
    result, _ = run_training(tiny_config(train={"train_iters": 8, "exit_interval": 3},
                                         checkpoint={"save": save}))
    assert (result.iteration, result.exit_reason) == (3, "exit-interval")
    assert read_latest_iteration(save) == 3
    save = str(tmp_path / "b")
    result, _ = run_training(tiny_config(train={"train_iters": 8, "exit_duration_in_mins": 1e-9},
                                         checkpoint={"save": save}))
    assert (result.iteration, result.exit_reason) == (1, "exit-duration")
    assert read_latest_iteration(save) == 1
