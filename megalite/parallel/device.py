"""Which device and process-group backend this rank uses, decided in one place, and the
GPU set-up checks that run before any work.

Device (``--device``, :func:`select_device`):

=========  ================================================================================
``auto``   ``cuda:LOCAL_RANK`` when a CUDA GPU is visible, else ``cpu``
``cpu``    ``cpu`` even where GPUs are visible (gloo, fp32/bf16 on the CPU)
``cuda``   ``cuda:LOCAL_RANK``; an error when no GPU is visible
=========  ================================================================================

The environment variable ``MEGALITE_DEVICE`` (``auto|cpu|cuda``) stands in for ``--device
auto``: an explicit ``--device cpu|cuda`` wins over it. The test suite sets
``MEGALITE_DEVICE=cpu`` (``tests/conftest.py``) so every test and every rank it spawns runs
on CPU/gloo whatever the host has.

Backend (``--distributed-backend``, :func:`select_backend`): ``auto`` is nccl on a CUDA
device, else gloo.

Set-up mistakes stop with one :class:`DeviceSetupError` sentence naming the values and the
fix, before the process group or the model exists (:func:`check_device_setup`): more ranks
on a node than visible GPUs, ``--device cuda`` or ``--distributed-backend nccl`` without a
usable GPU, ``--bf16`` on a GPU older than compute capability 8.0, ``--attention-backend
flash`` without flash-attn (or off CUDA, or in fp32).

What the host has is read through four small functions (:func:`visible_gpu_count`,
:func:`gpu_capability`, :func:`gpu_name`, :func:`flash_attn_installed`) so tests can
monkeypatch a host with N GPUs of capability (major, minor) on a machine without any.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megalite.config import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEVICE_ENV = "MEGALITE_DEVICE"
BF16_MIN_CAPABILITY = (8, 0)


class DeviceSetupError(ConfigError):
    """The requested device, backend, precision or kernel cannot run on this host."""


# -- what the host has (monkeypatched by tests) -----------------------------------------------
def visible_gpu_count() -> int:
    """CUDA GPUs this process can see (after ``CUDA_VISIBLE_DEVICES``); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_capability(index: int) -> tuple[int, int]:
    """Compute capability (major, minor) of visible GPU ``index``."""
    return tuple(torch.cuda.get_device_capability(index))


def gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def flash_attn_installed() -> bool:
    """Whether the ``flash_attn`` package can be imported (looked up, not imported)."""
    return importlib.util.find_spec("flash_attn") is not None


# -- decisions ------------------------------------------------------------------------------
def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes on this node (torchrun's ``LOCAL_WORLD_SIZE``; else LOCAL_RANK + 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank() + 1)))


def device_request(flag: str = "auto") -> tuple[str, str]:
    """The requested device kind and where the request came from, as the user wrote it:
    ``("cuda", "--device cuda")``, ``("cpu", "MEGALITE_DEVICE=cpu")``, ``("auto", ...)``."""
    if flag not in DEVICE_CHOICES:
        raise DeviceSetupError(f"--device {flag!r} is not one of {', '.join(DEVICE_CHOICES)}; "
                               "pick one of those")
    if flag != "auto":
        return flag, f"--device {flag}"
    env = os.environ.get(DEVICE_ENV, "").strip().lower()
    if env:
        if env not in DEVICE_CHOICES:
            raise DeviceSetupError(f"{DEVICE_ENV}={env!r} is not one of "
                                   f"{', '.join(DEVICE_CHOICES)}; set one of those or unset it")
        return env, f"{DEVICE_ENV}={env}"
    return "auto", "--device auto"


def _no_gpu_reason() -> str:
    """Why no GPU is visible, in a few words."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"none is visible with CUDA_VISIBLE_DEVICES={visible!r}"
    return "torch.cuda.is_available() is False"


def select_device(flag: str = "auto") -> torch.device:
    """This rank's device for ``--device flag`` (see the module docstring): ``cpu`` or
    ``cuda:LOCAL_RANK``. Raises :class:`DeviceSetupError` when CUDA is requested and there is
    no GPU, or when this node runs more ranks than it has visible GPUs."""
    kind, source = device_request(flag)
    gpus = visible_gpu_count()
    if kind == "cpu" or (kind == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise DeviceSetupError(f"{source} asks for a CUDA GPU but {_no_gpu_reason()}; "
                               "use --device cpu (or auto) to train on the CPU")
    rank, ranks = local_rank(), local_world_size()
    if rank >= gpus or ranks > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise DeviceSetupError(
            f"{max(ranks, rank + 1)} ranks on this node (local rank {rank}) but {gpus} "
            f"visible GPU{'s' if gpus != 1 else ''}{where}, and each rank needs its own GPU; "
            f"launch at most --nproc_per_node {gpus}, or use --device cpu to run the ranks "
            "on the CPU")
    return torch.device("cuda", rank)


def select_backend(backend: str, device: torch.device, device_flag: str = "auto") -> str:
    """The ``torch.distributed`` backend for ``--distributed-backend backend`` on ``device``
    (chosen by :func:`select_device` from ``device_flag``): ``auto`` is nccl on CUDA, else
    gloo. nccl off CUDA raises :class:`DeviceSetupError`."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        kind, source = device_request(device_flag)
        why = f"{source} selects the CPU" if kind == "cpu" else \
            f"no CUDA GPU is usable ({_no_gpu_reason()})"
        raise DeviceSetupError(f"--distributed-backend nccl needs CUDA GPUs but {why}; use "
                               "--distributed-backend gloo (or auto) for CPU ranks")
    return backend


def check_precision_and_kernels(device: torch.device, *, bf16: bool = False,
                                fp16: bool = False, attention_backend: str = "auto") -> None:
    """Raise :class:`DeviceSetupError` when ``--bf16`` is set on a GPU without bf16 or
    ``--attention-backend flash`` cannot run (flash-attn missing, not CUDA, not bf16/fp16)."""
    if bf16 and device.type == "cuda":
        cap = gpu_capability(device.index or 0)
        if tuple(cap) < BF16_MIN_CAPABILITY:
            raise DeviceSetupError(
                f"--bf16 needs a GPU of compute capability {BF16_MIN_CAPABILITY[0]}."
                f"{BF16_MIN_CAPABILITY[1]} or newer (Ampere+), but {device} "
                f"({gpu_name(device.index or 0)}) has {cap[0]}.{cap[1]}; train with --fp16 "
                "instead, or in fp32 without either flag")
    if attention_backend == "flash":
        if not flash_attn_installed():
            raise DeviceSetupError(
                "--attention-backend flash needs the flash-attn package, which is not "
                "installed here; pip install flash-attn (CUDA only), or use "
                "--attention-backend auto (flash when present, else sdpa) or sdpa")
        if device.type != "cuda":
            raise DeviceSetupError(
                f"--attention-backend flash runs on CUDA GPUs only but the device is "
                f"{device}; use --attention-backend sdpa (or auto) on the CPU")
        if not (bf16 or fp16):
            raise DeviceSetupError(
                "--attention-backend flash runs in bf16/fp16 only but the run is fp32; add "
                "--bf16 (or --fp16), or use --attention-backend sdpa (or auto)")


def check_device_setup(cfg) -> tuple[torch.device, str]:
    """Every device check for a :class:`~megalite.config.MegaliteConfig`, before any work:
    returns (device, backend) or raises :class:`DeviceSetupError`."""
    p, m = cfg.parallel, cfg.model
    device = select_device(p.device)
    backend = select_backend(p.distributed_backend, device, p.device)
    check_precision_and_kernels(device, bf16=bool(m.bf16), fp16=bool(m.fp16),
                                attention_backend=m.attention_backend)
    return device, backend


def host_memory_pinned(device: torch.device, flag: str) -> bool:
    """Whether host buffers that offload from ``device`` are pinned: yes for CUDA, no on a
    CPU-only run (host and device are the same memory). Any other device, or a CUDA host
    that cannot pin, cannot offload: a ConfigError naming ``flag``."""
    if device.type == "cpu":
        return False
    if device.type == "cuda":
        try:
            torch.empty(1, pin_memory=True)
        except RuntimeError as e:
            raise ConfigError(f"{flag} needs pinned host memory, which this host does not "
                              f"offer for {device} ({e}); run without it") from None
        return True
    raise ConfigError(f"{flag} needs pinned host memory, which device {device.type} does "
                      "not offer; run without it")
