"""Whether fp8 training (``--fp8-format`` and friends) can run on this device, checked
before any work, and the once-per-step update of delayed scaling.

megalite's own fp8 GEMMs (:mod:`megalite.layers.fp8`) run on the CPU (``torch._scaled_mm``
takes per-tensor fp8 scales there; block scales are emulated) and on CUDA GPUs of compute
capability 8.9 or newer (Ada, Hopper, Blackwell; ``blockwise`` scales go to torch's
block-scaled kernel on Hopper and are emulated elsewhere); an older GPU has no fp8 GEMMs and is
refused with the alternative (``--bf16``). The flags themselves are parsed and validated
in :class:`megalite.config.ModelConfig` (fp16, untileable shapes).

    check_fp8_available(cfg.model, ps.device)   # first thing build_components does
    finish_fp8_step(model_chunks, ps)          # train_step, before the optimizer step
"""

from __future__ import annotations

import dataclasses

import torch

from megalite.arguments import flag_of
from megalite.config import ConfigError
from megalite.layers.fp8 import finish_step

MIN_CAPABILITY = (8, 9)


def fp8_flags(model_cfg) -> list[str]:
    """The fp8 flags set away from their defaults, as written on the command line."""
    return [flag_of(f) for f in dataclasses.fields(model_cfg)
            if f.name.startswith("fp8_") and getattr(model_cfg, f.name) != f.default]


def fp8_unavailable(device) -> str | None:
    """Why fp8 GEMMs cannot run on ``device`` (a ``torch.device``), or None."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the device is {device.type}, neither the CPU nor a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"the GPU has compute capability {capability[0]}.{capability[1]}, which has "
                f"no fp8 GEMMs")
    return None


def check_fp8_available(model_cfg, device) -> None:
    """Raise :class:`ConfigError` (one sentence: why, and which flags to drop) when fp8
    flags are set and fp8 cannot run on ``device``; nothing when no fp8 flag is set."""
    flags = fp8_flags(model_cfg)
    if not flags or model_cfg.fp8_format is None:
        return
    reason = fp8_unavailable(device)
    if reason is None:
        return
    raise ConfigError(
        f"fp8 training cannot run here: {reason} (fp8 needs the CPU or a CUDA GPU of "
        f"compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer); "
        f"drop {' '.join(flags)} to train in --bf16 instead")


def finish_fp8_step(model_chunks, ps) -> None:
    """Delayed scaling's history update after a step's backward passes (collectives over
    ``ps.tp`` and ``ps.dp_cp``; see :func:`megalite.layers.fp8.scaling.finish_step`)."""
    finish_step(model_chunks, ps)
