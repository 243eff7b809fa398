"""Whether fp8 training (``--fp8-format`` and friends) can run here, checked before any work.

fp8 GEMMs need a CUDA device of compute capability 8.9 or newer (Ada, Hopper, Blackwell)
and an fp8 backend (Transformer Engine, ``transformer_engine``, looked up lazily with
``importlib.util.find_spec``, never imported here); megalite's own layers do not run fp8
GEMMs yet, so with both present a run still stops rather than silently training in
another precision. The flags themselves are parsed and validated in
:class:`megalite.config.ModelConfig`.

    check_fp8_available(cfg.model, ps.device)   # first thing build_components does
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from megalite.config import ConfigError

MIN_CAPABILITY = (8, 9)
BACKEND = "transformer_engine"


def fp8_flags(model_cfg) -> list[str]:
    """The fp8 flags set away from their defaults, as written on the command line."""
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(model_cfg)
            if f.name.startswith("fp8_") and getattr(model_cfg, f.name) != f.default]


def fp8_unavailable(device) -> str | None:
    """Why fp8 cannot run on ``device`` (a ``torch.device``); while megalite's layers have
    no fp8 GEMMs there is always a reason, the last one where the hardware would do."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the device is {device.type}, not a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"the GPU has compute capability {capability[0]}.{capability[1]}"
    if importlib.util.find_spec(BACKEND) is None:
        return f"no fp8 backend ({BACKEND}) is installed"
    return "megalite's layers do not run fp8 GEMMs yet"


def check_fp8_available(model_cfg, device) -> None:
    """Raise :class:`ConfigError` (one sentence: why, and which flags to drop) when fp8
    flags are set and fp8 cannot run on ``device``; nothing when no fp8 flag is set."""
    flags = fp8_flags(model_cfg)
    if not flags:
        return
    reason = fp8_unavailable(device)
    if reason is None:
        return
    raise ConfigError(
        f"fp8 training cannot run here: {reason} (fp8 needs a CUDA GPU of compute "
        f"capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer with {BACKEND}); "
        f"drop {' '.join(flags)} to train in --bf16 or fp32 instead")
