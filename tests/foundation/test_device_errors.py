"""Device and backend choice, and the GPU set-up errors, on a CPU host: the visible GPUs,
their compute capability and flash-attn are monkeypatched (megalite.parallel.device)."""

from __future__ import annotations

import os

import pytest
import torch

from megalite.config import ConfigError
from megalite.parallel import device as dev
from tests.distributed.harness import run_distributed
from tests.training.common import tiny_config, tiny_flags


@pytest.fixture
def host(monkeypatch):
    """A fake host: ``host(gpus=1, capability=(9, 0), flash=False, local_rank=0,
    local_world=None, env_device=None)``."""

    def make(gpus=1, capability=(9, 0), flash=False, local_rank=0, local_world=None,
             env_device=None):
        monkeypatch.setattr(dev, "visible_gpu_count", lambda: gpus)
        monkeypatch.setattr(dev, "gpu_capability", lambda index: capability)
        monkeypatch.setattr(dev, "gpu_name", lambda index: "Fake GPU")
        monkeypatch.setattr(dev, "flash_attn_installed", lambda: flash)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        if local_world is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        if env_device is None:
            monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
        else:
            monkeypatch.setenv(dev.DEVICE_ENV, env_device)

    return make


def _one_sentence(message: str) -> None:
    assert "\n" not in message and message.count("; ") >= 1, message


# -- choices ----------------------------------------------------------------------------------
def _rank_device(rank, world_size):
    return dev.device_request("auto"), str(dev.select_device("auto"))


def test_the_suite_runs_on_cpu():
    """tests/conftest.py pins the device, here and in the pooled ranks: the tests never
    pick a GPU behind our back (MEGALITE_TEST_DEVICE=cuda asks for one)."""
    if os.environ.get("MEGALITE_TEST_DEVICE", "cpu") != "cpu":
        pytest.skip("MEGALITE_TEST_DEVICE asks for another device")
    assert dev.device_request("auto") == ("cpu", "MEGALITE_DEVICE=cpu")
    assert dev.select_device("auto") == torch.device("cpu")
    assert run_distributed(2, _rank_device) == [(("cpu", "MEGALITE_DEVICE=cpu"), "cpu")] * 2


def test_auto_picks_cuda_local_rank_when_gpus_are_visible(host):
    host(gpus=4, local_rank=3, local_world=4)
    assert dev.select_device("auto") == torch.device("cuda", 3)
    assert dev.select_backend("auto", dev.select_device("auto")) == "nccl"
    host(gpus=0)
    assert dev.select_device("auto") == torch.device("cpu")
    assert dev.select_backend("auto", torch.device("cpu")) == "gloo"


def test_flag_wins_over_environment(host):
    host(gpus=2, env_device="cpu")
    assert dev.select_device("auto") == torch.device("cpu")
    assert dev.select_device("cuda") == torch.device("cuda", 0)
    host(gpus=2, env_device="cuda")
    assert dev.select_device("cpu") == torch.device("cpu")


def test_cpu_device_on_a_gpu_host_with_more_ranks_than_gpus(host):
    host(gpus=1, local_rank=3, local_world=4)
    assert dev.select_device("cpu") == torch.device("cpu")


# -- the four set-up mistakes ------------------------------------------------------------------
def test_more_ranks_than_gpus(host):
    host(gpus=1, local_rank=1, local_world=2)
    with pytest.raises(dev.DeviceSetupError) as e:
        dev.select_device("auto")
    msg = str(e.value)
    _one_sentence(msg)
    assert "2 ranks on this node (local rank 1) but 1 visible GPU" in msg
    assert "--nproc_per_node 1" in msg and "--device cpu" in msg
    # rank 0 of the same launch stops too (it would wait for rank 1 forever otherwise)
    host(gpus=1, local_rank=0, local_world=2)
    with pytest.raises(dev.DeviceSetupError, match="2 ranks on this node"):
        dev.select_device("cuda")


def test_cuda_requested_without_gpu(host):
    host(gpus=0)
    with pytest.raises(dev.DeviceSetupError) as e:
        dev.select_device("cuda")
    _one_sentence(str(e.value))
    assert str(e.value).startswith("--device cuda asks for a CUDA GPU but ")
    host(gpus=0, env_device="cuda")
    with pytest.raises(dev.DeviceSetupError, match="MEGALITE_DEVICE=cuda asks for a CUDA GPU"):
        dev.select_device("auto")


def test_nccl_without_cuda(host):
    host(gpus=0)
    with pytest.raises(dev.DeviceSetupError) as e:
        dev.select_backend("nccl", dev.select_device("auto"), "auto")
    _one_sentence(str(e.value))
    assert "--distributed-backend nccl needs CUDA GPUs but no CUDA GPU is usable" in str(e.value)
    assert "--distributed-backend gloo" in str(e.value)
    host(gpus=8)
    with pytest.raises(dev.DeviceSetupError, match="--device cpu selects the CPU"):
        dev.select_backend("nccl", dev.select_device("cpu"), "cpu")
    assert dev.select_backend("gloo", dev.select_device("cuda"), "cuda") == "gloo"


def test_bf16_on_a_gpu_without_bf16(host):
    host(gpus=1, capability=(7, 0))
    with pytest.raises(dev.DeviceSetupError) as e:
        dev.check_precision_and_kernels(torch.device("cuda", 0), bf16=True)
    msg = str(e.value)
    _one_sentence(msg)
    assert "8.0 or newer" in msg and "has 7.0" in msg and "Fake GPU" in msg and "--fp16" in msg
    dev.check_precision_and_kernels(torch.device("cuda", 0), fp16=True)  # fp16 is fine there
    host(gpus=1, capability=(8, 0))
    dev.check_precision_and_kernels(torch.device("cuda", 0), bf16=True)
    dev.check_precision_and_kernels(torch.device("cpu"), bf16=True)  # CPUs do bf16


def test_flash_without_flash_attn(host):
    host(gpus=1, flash=False)
    with pytest.raises(dev.DeviceSetupError) as e:
        dev.check_precision_and_kernels(torch.device("cuda", 0), bf16=True,
                                        attention_backend="flash")
    _one_sentence(str(e.value))
    assert "flash-attn package, which is not installed" in str(e.value)
    assert "--attention-backend auto" in str(e.value)
    host(gpus=1, flash=True)
    dev.check_precision_and_kernels(torch.device("cuda", 0), bf16=True,
                                    attention_backend="flash")
    with pytest.raises(dev.DeviceSetupError, match="bf16/fp16 only but the run is fp32"):
        dev.check_precision_and_kernels(torch.device("cuda", 0), attention_backend="flash")
    with pytest.raises(dev.DeviceSetupError, match="CUDA GPUs only but the device is cpu"):
        dev.check_precision_and_kernels(torch.device("cpu"), bf16=True,
                                        attention_backend="flash")


def test_errors_are_config_errors_and_bad_values_are_named(host):
    assert issubclass(dev.DeviceSetupError, ConfigError)
    host(gpus=1, env_device="gpu")
    with pytest.raises(dev.DeviceSetupError, match="MEGALITE_DEVICE='gpu' is not one of"):
        dev.select_device("auto")
    with pytest.raises(ConfigError, match="device"):
        tiny_config(parallel={"device": "tpu"})


def test_check_device_setup_reads_the_config(host):
    host(gpus=2, capability=(8, 6))
    cfg = tiny_config(parallel={"device": "cuda"}, model={"bf16": True})
    assert dev.check_device_setup(cfg) == (torch.device("cuda", 0), "nccl")
    cfg = tiny_config(model={"bf16": True})
    assert dev.check_device_setup(cfg) == (torch.device("cuda", 0), "nccl")
    host(gpus=2, capability=(8, 6), env_device="cpu")  # what tests/conftest.py sets
    assert dev.check_device_setup(cfg) == (torch.device("cpu"), "gloo")


# -- through the entrypoint: one line per rank, exit 2, before any process group ---------------
def test_entrypoint_two_ranks_on_one_gpu(host, monkeypatch, capsys):
    from pretrain.pretrain_gpt import main

    for rank in (0, 1):
        host(gpus=1, local_rank=rank, local_world=2, env_device="auto")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")  # nothing may connect: the check comes first
        flags = tiny_flags(**{"--distributed-backend": "auto"})
        assert main(flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"megalite: error (rank {rank}): 2 ranks on this node "
                                 f"(local rank {rank}) but 1 visible GPU")
    assert not torch.distributed.is_initialized()


def test_entrypoint_nccl_on_cpu(host, monkeypatch, capsys):
    from pretrain.pretrain_gpt import main

    host(gpus=0, env_device="cpu")
    assert main(tiny_flags(**{"--distributed-backend": "nccl"})) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("megalite: error (rank 0): --distributed-backend nccl needs CUDA GPUs but "
                   "MEGALITE_DEVICE=cpu selects the CPU; use --distributed-backend gloo (or "
                   "auto) for CPU ranks")
