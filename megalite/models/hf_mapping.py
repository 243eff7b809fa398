"""Parameter names and configs, megalite <-> Hugging Face ``transformers``, by family name.

A thin facade over :mod:`megalite.models.families`, where each family's spec holds its
name table, config translation and layout notes (GPT-2's ``Conv1D`` in ``gpt2.py``, fused
q/k/v and RoPE in ``llama.py``, the expert table in ``mixtral.py``). State dicts are full
(unsharded), as from ``GPTModel.full_state_dict()``.
"""

from __future__ import annotations

import torch

from megalite.models.families import family_for_hf, family_names, get_family

FAMILIES = family_names()


def to_hf_state_dict(state: dict[str, torch.Tensor], model_cfg, family: str
                     ) -> dict[str, torch.Tensor]:
    """Our full state dict -> the family's ``transformers`` model's state dict."""
    return get_family(family).to_hf(state, model_cfg)


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], model_cfg, family: str
                       ) -> dict[str, torch.Tensor]:
    """A ``transformers`` state dict (in-memory or hub-file names) -> our full state dict."""
    return get_family(family).from_hf(hf_state, model_cfg)


def hf_config(model_cfg, family: str):
    """A ``transformers`` config equivalent to ``model_cfg``."""
    return get_family(family).hf_config(model_cfg)


def model_config_from_hf(hf_cfg) -> tuple[str, dict]:
    """(family name, ``ModelConfig`` keyword arguments) for a ``transformers`` config;
    ``ValueError`` for what megalite cannot represent."""
    spec = family_for_hf(getattr(hf_cfg, "model_type", None))
    return spec.name, spec.config_from_hf(hf_cfg)
