"""Model families (GPT-2, Llama, Mixtral, ...): one :class:`FamilySpec` each, in a registry.

A spec holds everything family-specific: the ``ModelConfig`` settings that make the
family, the Hugging Face tensor names and config translation, and the test of whether a
model belongs to it. Callers never compare family names; they ask the registry::

    spec = family_of(model_cfg)               # the family whose spec matches the model
    spec = family_for_hf(hf_cfg.model_type)   # the family of a transformers config
    hf_state = spec.to_hf(model.full_state_dict(), model_cfg)

A new family (Qwen2's QKV bias, Mistral's sliding window, ...) is one file here defining
a ``FamilySpec`` subclass, plus its line in ``BUILTIN`` below.
"""

from __future__ import annotations

from megalite.models.families import (
    deepseek_v2,
    deepseek_v3,
    gpt2,
    llama,
    mixtral,
    qwen3,
    qwen3_moe,
)
from megalite.models.families.spec import FamilySpec

# In the order family_of asks them; the built-in families' matches() are disjoint.
BUILTIN = (gpt2.SPEC, llama.SPEC, mixtral.SPEC, qwen3.SPEC, qwen3_moe.SPEC, deepseek_v3.SPEC,
           deepseek_v2.SPEC)


class FamilyRegistry:
    """Specs by name and by ``transformers`` model type."""

    def __init__(self, specs=()):
        self._specs: dict[str, FamilySpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: FamilySpec) -> FamilySpec:
        for taken in self._specs.values():
            if spec.name == taken.name or spec.hf_model_type == taken.hf_model_type:
                raise ValueError(f"{spec!r} clashes with registered {taken!r} (name "
                                 f"{taken.name!r}, model_type {taken.hf_model_type!r})")
        self._specs[spec.name] = spec
        return spec

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def get(self, name: str) -> FamilySpec:
        if name not in self._specs:
            raise ValueError(f"unknown model family {name!r}; choose one of {self.names()}")
        return self._specs[name]

    def for_hf(self, model_type: str | None) -> FamilySpec:
        """The family of a ``transformers`` config's ``model_type``."""
        for spec in self._specs.values():
            if spec.hf_model_type == model_type:
                return spec
        known = ", ".join(s.hf_model_type for s in self._specs.values())
        raise ValueError(f"model_type {model_type!r} is not supported; megalite converts "
                         f"{known}")

    def family_of(self, model_cfg) -> FamilySpec:
        """The first registered family whose spec matches ``model_cfg``; otherwise
        ``ValueError`` with every family's reasons."""
        reasons = []
        for spec in self._specs.values():
            found = spec.problems(model_cfg)
            if not found:
                return spec
            reasons.append(f"{spec.name}: {', '.join(found)}")
        raise ValueError("no Hugging Face family for this model (" + "; ".join(reasons) + ")")


REGISTRY = FamilyRegistry(BUILTIN)
register = REGISTRY.register
get_family = REGISTRY.get
family_for_hf = REGISTRY.for_hf
family_of = REGISTRY.family_of


def family_names() -> tuple[str, ...]:
    """Names of the registered families, in registration order."""
    return REGISTRY.names()


__all__ = ["BUILTIN", "FamilyRegistry", "FamilySpec", "REGISTRY", "family_for_hf",
           "family_names", "family_of", "get_family", "register"]
