"""How megalite treats Megatron-LM flags: implemented, implemented differently, accepted
without effect, or refused.

Two users of the same facts, both read from the parser and the fields' metadata (never from
a hand-kept list):

* :func:`no_effect_line` - the one start-up line naming the flags a run set that megalite
  accepts but that change nothing here (fields declared with ``arg(..., no_effect=why)``)::

      accepted, no effect here: --no-mmap-bin-files (...); --use-mcore-models (...)

* :func:`flag_status` - what megalite does with one flag and its values, for the
  compatibility table in ``docs/megatron.md`` (``tools/megatron_flags.py``).

The one hand-kept list is :data:`DIFFERENCES`: flag values the parser takes and acts on
but whose result is not Megatron-LM's (the same name for another file format).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from megalite.arguments import build_parser, flag_of
from megalite.config import SECTIONS
from megalite.config.fields import no_effect_settings

IMPLEMENTED = "implemented"
NO_EFFECT = "accepted, no effect here"
REFUSED = "refused"
DIFFERENT = "implemented differently"

# (flag, values) -> what megalite does instead of what Megatron-LM does.
DIFFERENCES = {
    ("--ckpt-format", ("torch_dist",)): (
        "megalite saves its own layout-free torch.distributed.checkpoint format under this "
        "name, which Megatron-LM cannot --load; tools/convert_checkpoint.py converts "
        "Megatron-Core torch_dist checkpoints in (--source megatron) and out "
        "(--target megatron)"),
    ("--optimizer", ("lion",)): (
        "Lion for the linear weights and AdamW for the rest, as Megatron-LM splits them, "
        "but with --lion-beta1/2 as Lion's betas: Megatron-Core 0.19.2's --optimizer lion "
        "takes --adam-beta1/2 (its --lion-beta1/2 reach only --muon-scalar-optimizer "
        "lion); set --lion-beta1/2 to the Adam betas to train as it does"),
}


def _field(name: str) -> dataclasses.Field:
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
    raise KeyError(name)


def no_effect_flags(cfg) -> list[str]:
    """``"--flag [value] (reason)"`` for every no-effect field ``cfg`` sets away from its
    default, over all sections, in section order."""
    out = []
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for name, reason in no_effect_settings(section):
            f, value = _field(name), getattr(section, name)
            shown = flag_of(f) if isinstance(value, bool) else f"{flag_of(f)} {value}"
            out.append(f"{shown} ({reason})")
    return out


def no_effect_line(cfg) -> str | None:
    """The start-up line listing :func:`no_effect_flags`, or None when there are none."""
    flags = no_effect_flags(cfg)
    return "accepted, no effect here: " + "; ".join(flags) if flags else None


def flag_status(flag: str, values: Sequence[str] = (),
                parser: argparse.ArgumentParser | None = None) -> tuple[str, str]:
    """(status, reason) of ``flag`` given with ``values``, as megalite's parser sees it.

    IMPLEMENTED: a known flag that acts. DIFFERENT: one that acts with another result than
    Megatron-LM's (:data:`DIFFERENCES`, the reason says what). NO_EFFECT: a known flag whose
    field is declared ``no_effect``; the reason is that declaration. REFUSED: an unknown
    flag, or values the parser rejects (a choice it does not offer); the reason is the
    parser's message.
    Checks that relate several flags run later, at start-up, and are not judged here.
    """
    parser = parser or build_parser()
    try:
        ns, unknown = parser.parse_known_args([flag, *values])
    except argparse.ArgumentError as e:
        return REFUSED, str(e)
    if unknown:
        return REFUSED, "unknown flag"
    dests = [d for d in vars(ns) if d != "config"]
    if len(dests) != 1:
        return IMPLEMENTED, ""
    differs = DIFFERENCES.get((flag, tuple(values)))
    if differs:
        return DIFFERENT, differs
    meta = _field(dests[0]).metadata
    value = getattr(ns, dests[0])
    reason = meta.get("no_effect") or (meta.get("no_effect_values", {}).get(value)
                                       if isinstance(value, str) else None)
    return (NO_EFFECT, reason) if reason else (IMPLEMENTED, "")


def has_choices(flag: str, parser: argparse.ArgumentParser | None = None) -> bool:
    """Whether a known ``flag`` takes one of a fixed set of values (so rows of the table
    differ by value)."""
    parser = parser or build_parser()
    for action in parser._actions:  # argparse offers no public lookup by option string
        if flag in action.option_strings:
            return bool(action.choices)
    return False
