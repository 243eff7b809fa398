"""Typed configuration for megalite: the field helper and the error type.

Every setting is a field of one of the section dataclasses below. The field name is the
Megatron-LM flag name with dashes turned into underscores (``tensor_model_parallel_size``
is ``--tensor-model-parallel-size``); ``megalite.arguments`` generates the command line
from these fields, so a flag is declared exactly once, here.

Validation that concerns one section lives in that section's ``__post_init__``; checks that
relate sections (heads vs tensor parallel size, batch sizes vs data parallel size, world size
vs the parallel layout) live in :meth:`MegaliteConfig.validate`. Every problem raises
:class:`ConfigError` with one sentence that names the values and how to fix them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any

from megalite.errors import EXIT_CONFIG, KnownError


class ConfigError(KnownError, ValueError):
    """A configuration value (or combination of values) that cannot work."""

    exit_code = EXIT_CONFIG


def arg(default: Any = None, help: str = "", *, flag: str | None = None,
        action: str | None = None, choices: tuple | Callable[[], tuple] | None = None,
        nargs: str | None = None, aliases: tuple = (), cli: bool = True,
        no_effect: str | None = None, no_effect_values: dict | None = None):
    """A dataclass field carrying its command-line description.

    flag:      the CLI flag when it differs from ``--field-name`` (e.g.
               ``--disable-bias-linear`` for ``add_bias_linear``).
    action:    ``store_true`` / ``store_false`` for booleans (defaults: store_true when the
               default is False).
    choices:   the allowed values, or a function returning them (read when the parser is
               built or a value is checked): a registry elsewhere -- the attention kernels
               -- then lists its names once, and a new entry is a flag value at once.
    aliases:   extra flag spellings accepted for the same field.
    cli:       False for derived fields that are not flags.
    no_effect: for a Megatron flag megalite accepts but that changes nothing here (it tunes
               speed on other hardware), why; set away from its default, it is listed once at
               start-up as "accepted, no effect here" (:func:`no_effect_settings`).
    no_effect_values: {value: why} for values of a flag that otherwise acts which megalite
               accepts and runs as another (Megatron's flex dispatcher runs as alltoall);
               listed at start-up the same way.
    """
    meta = dict(help=help, flag=flag, action=action, choices=choices, nargs=nargs,
                aliases=tuple(aliases), cli=cli, no_effect=no_effect,
                no_effect_values=dict(no_effect_values or {}))
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The allowed values of field ``f`` (its ``choices``, called when a function)."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def check_choices(obj: Any) -> None:
    """Every field declared with ``choices`` holds one of them (None allowed when default;
    a list field, each of its values)."""
    for f in dataclasses.fields(obj):
        choices = choices_of(f)
        value = getattr(obj, f.name)
        if choices and isinstance(value, list):
            bad = [v for v in value if v not in choices]
            if bad:
                raise ConfigError(f"{f.name} takes {', '.join(map(str, choices))}; got "
                                  f"{', '.join(map(str, bad))}")
            continue
        if choices and value not in choices and not (value is None and f.default is None):
            raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; "
                              f"got {value!r}")


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            require(value > 0, f"{name} must be positive, got {value}")


def no_effect_settings(section: Any) -> list[tuple[str, str]]:
    """(field name, reason) of ``section``'s fields marked ``no_effect`` whose value differs
    from the default, and of fields holding one of their ``no_effect_values``."""
    out = []
    for f in dataclasses.fields(section):
        reason = f.metadata.get("no_effect")
        value = getattr(section, f.name)
        if reason and value != f.default:
            out.append((f.name, reason))
        elif isinstance(value, str) and value in f.metadata.get("no_effect_values", {}):
            out.append((f.name, f.metadata["no_effect_values"][value]))
    return out
