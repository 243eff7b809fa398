"""``--async-save``: the state is staged, written in a background
thread while training goes on, and ``latest`` moves only once every rank finished."""

import os
import threading

import torch

import megalite.checkpoint.save as ckpt_save
from megalite.checkpoint import CheckpointSaver, LoadOptions, load_checkpoint, read_latest_iteration
from megalite.parallel.state import ParallelState
from megalite.training.build import default_model_provider
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config


def test_async_save_publishes_staged_state_at_finalize(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    cfg = tiny_config()
    cfg.model.vocab_size = 61
    ps = ParallelState.build(cfg.parallel)
    model = default_model_provider(cfg, ps)
    snapshot = model.full_state_dict()
    release, real_write = threading.Event(), ckpt_save.write_blocks

    def slow_write(*args):
        assert release.wait(30)
        real_write(*args)

    monkeypatch.setattr(ckpt_save, "write_blocks", slow_write)
    saver = CheckpointSaver(ps, async_save=True)
    saver.save(root, 7, model, None, None, cfg.to_dict(), 56, save_rng=False)
    with torch.no_grad():                      # training goes on and changes the weights
        for p in model.parameters():
            p.add_(1.0)
    assert read_latest_iteration(root) is None
    assert os.listdir(root) == ["iter_0000007.tmp"]
    release.set()
    assert saver.finalize() == os.path.join(root, "iter_0000007")
    assert read_latest_iteration(root) == 7 and saver.finalize() is None
    saver.close()
    loaded = load_checkpoint(root, model, None, None, ps, LoadOptions(load_rng=False))
    assert (loaded.iteration, loaded.consumed_samples) == (7, 56)
    for name, full in model.full_state_dict().items():   # the staged copy, not the later
        assert torch.equal(full, snapshot[name]), name  # weights (padding rows unsaved)


def _async_body(rank, world_size, tmp):
    par = {"tensor_model_parallel_size": 2}
    straight, _ = run_training(tiny_config(world_size, parallel=par, train={"train_iters": 4}))
    ck = {"save": tmp, "save_interval": 1, "async_save": True}
    first, _ = run_training(tiny_config(world_size, parallel=par,
                                        train={"train_iters": 4, "exit_interval": 2},
                                        checkpoint=ck))
    latest = read_latest_iteration(tmp)
    second, _ = run_training(tiny_config(world_size, parallel=par, train={"train_iters": 4},
                                         checkpoint=dict(ck, load=tmp)))
    return straight.losses, {**first.losses, **second.losses}, latest


def test_async_save_on_two_ranks_resumes_exactly(tmp_path):
    tmp = str(tmp_path / "ckpt")
    for straight, resumed, latest in run_distributed(2, _async_body, tmp):
        assert resumed == straight
        assert latest == 2                       # published at exit, after the write
    assert sorted(os.listdir(tmp)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                       "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert read_latest_iteration(tmp) == 4
