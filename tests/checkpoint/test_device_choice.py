"""The device megalite chose, not ``torch.cuda.is_available()``, decides whether the RNG
checkpointing, the data loader and the profiler touch CUDA: a GPU
host run with ``--device cpu`` never creates a CUDA context. These tests fake a host with
CUDA available on this CPU machine; every CUDA entry point that would create a context
raises."""

from __future__ import annotations

import pytest
import torch

from megalite.checkpoint.rng import capture_rng_state, restore_rng_state
from megalite.data.samplers import build_data_loader
from megalite.training.profiling import profiler_activities
from tests.training.common import run_training, tiny_config


class Touched(AssertionError):
    pass


@pytest.fixture
def fake_cuda_host(monkeypatch):
    """CUDA reports two GPUs, but any call that would use one raises :class:`Touched`;
    returns the recorded (name, args) of the CUDA generator calls that are allowed by
    ``fake_cuda_host.allow = True``."""
    calls = []

    class Host:
        allow = False

    def guarded(name, result=None):
        def fn(*args, **kwargs):
            if not Host.allow:
                raise Touched(f"torch.cuda.{name} called while the device is cpu")
            calls.append((name, args))
            return result
        return fn

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("get_rng_state_all", "set_rng_state_all", "set_rng_state", "_lazy_init",
                 "init", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, guarded(name))
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        guarded("get_rng_state", torch.arange(8, dtype=torch.uint8)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", guarded("pin_memory"), raising=True)
    Host.calls = calls
    return Host


def test_rng_state_skips_cuda_on_a_cpu_device(fake_cuda_host):
    state = capture_rng_state(device=torch.device("cpu"))
    assert state["cuda"] is None
    a = torch.rand(3)
    restore_rng_state(dict(state, cuda=[torch.zeros(8, dtype=torch.uint8)]),
                      device=torch.device("cpu"))  # a GPU checkpoint resumed on CPU
    assert torch.equal(torch.rand(3), a)
    assert fake_cuda_host.calls == []


def test_rng_state_captures_only_the_chosen_cuda_device(fake_cuda_host):
    fake_cuda_host.allow = True
    dev = torch.device("cuda", 1)
    state = capture_rng_state(device=dev)
    assert torch.equal(state["cuda"], torch.arange(8, dtype=torch.uint8))
    assert fake_cuda_host.calls == [("get_rng_state", (dev,))]
    fake_cuda_host.calls.clear()
    restore_rng_state(state, device=dev)
    (name, (tensor, where)), = fake_cuda_host.calls
    assert name == "set_rng_state" and where == dev and torch.equal(tensor, state["cuda"])
    fake_cuda_host.calls.clear()  # an older save holding every device's state: this one's
    restore_rng_state(dict(state, cuda=[torch.zeros(8, dtype=torch.uint8), state["cuda"]]),
                      device=dev)
    assert torch.equal(fake_cuda_host.calls[0][1][0], state["cuda"])


def test_loader_pins_memory_only_for_a_cuda_device(fake_cuda_host):
    data = [{"tokens": torch.tensor([i, i + 1])} for i in range(4)]
    cpu = build_data_loader(data, 0, 2, 0, 1, device=torch.device("cpu"))
    assert cpu.pin_memory is False
    assert next(iter(cpu))["tokens"].tolist() == [[0, 1], [1, 2]]
    assert build_data_loader(data, 0, 2, 0, 1, device="cuda:0").pin_memory is True


def test_profiler_records_cuda_only_on_a_cuda_device(fake_cuda_host):
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    assert profiler_activities(torch.device("cpu")) == [cpu]
    assert profiler_activities(torch.device("cuda", 0)) == [cpu, cuda]


def test_cpu_run_with_cuda_visible_never_touches_it(fake_cuda_host, tmp_path):
    """Train (profiled, a save), then resume from the checkpoint (RNG restored): the
    whole path runs on cpu although CUDA reports GPUs; the resumed run's losses equal
    the uninterrupted one's."""
    save = str(tmp_path / "ckpt")
    profile = {"profile": True, "profile_step_start": 1, "profile_step_end": 2,
               "tensorboard_dir": str(tmp_path / "tb"), "metrics_jsonl": None}
    whole, c = run_training(tiny_config(train={"train_iters": 4}, logging=profile,
                                        checkpoint={"save": save, "save_interval": 2}))
    assert c.ps.device.type == "cpu"
    resumed, _ = run_training(tiny_config(train={"train_iters": 4},
                                          checkpoint={"load": save, "ckpt_step": 2}))
    assert resumed.losses == {i: whole.losses[i] for i in (3, 4)}
    assert fake_cuda_host.calls == []
