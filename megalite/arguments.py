"""Megatron-LM command-line flags and YAML files -> :class:`MegaliteConfig`.

The parser is generated from the config dataclasses: each field ``foo_bar`` becomes
``--foo-bar`` (or the ``flag`` its metadata names), so flags are declared once, in
``megalite/config/``. ``--config FILE.yaml`` takes the same keys with underscores, either
flat (``tensor_model_parallel_size: 2``) or grouped by section (``parallel: {...}``);
flags given on the command line override the file.

Unknown flags fail with the closest known flag as a suggestion.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Sequence
from typing import Any, Optional

from megalite.config import SECTIONS, ConfigError, MegaliteConfig
from megalite.config.fields import choices_of


class ArgumentError(ConfigError):
    """An unknown flag, a malformed value or a bad YAML file."""


def _base_type(tp: Any) -> Any:
    """int for Optional[int], etc. Annotations are strings under __future__ annotations."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing) | {"Optional": Optional})
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args and typing.get_origin(tp) is not list else tp
    if typing.get_origin(base) is list:  # list[int] with nargs: each value an int
        return typing.get_args(base)[0]
    return base


def _fields():
    """(section name, dataclass field, python type) for every CLI field."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                yield section, f, _base_type(hints[f.name])


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megalite", allow_abbrev=False, argument_default=argparse.SUPPRESS,
        exit_on_error=False,
        description="megalite: Megatron-LM compatible flags. Defaults are shown per flag.")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file with the same keys (underscored); flags override it.")
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    for section, f, ftype in _fields():
        meta = f.metadata
        names = [flag_of(f), *meta.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{meta.get('help', '')} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
        if ftype is bool:
            kwargs["action"] = meta.get("action") or "store_true"
            if kwargs["action"] == "store_false":   # the flag turns the described thing off
                kwargs["help"] = f"Turns off (on without this flag): {meta.get('help', '')}"
        else:
            kwargs["type"] = str if ftype is list else ftype
            if choices_of(f):
                kwargs["choices"] = choices_of(f)
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
        groups[section].add_argument(*names, **kwargs)
    return parser


def all_flags() -> list[str]:
    flags = ["--config"]
    for _, f, _ in _fields():
        flags += [flag_of(f), *f.metadata.get("aliases", ())]
    return flags


def _suggest(unknown: str) -> str:
    name = unknown.split("=", 1)[0]
    close = difflib.get_close_matches(name, all_flags(), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else "; see --help for the list of flags"


def load_yaml(path: str) -> dict[str, Any]:
    """Flat ``{field: value}`` from a YAML file (flat or grouped by section)."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ArgumentError(f"--config {path}: file not found") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of keys to values")
    known = {f.name: section for section, f, _ in _fields()}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                flat[sub.replace("-", "_")] = v
        else:
            flat[key] = value
    for key in flat:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ArgumentError(f"--config {path}: unknown key '{key}'{hint}")
    specs = _field_specs()
    return {key: coerce_value(key, value, specs[key], f"--config {path}")
            for key, value in flat.items()}


# -- YAML values get the command line's types and choices --------------------------------
_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")
_TYPE_NAMES = {bool: "a boolean (true/false)", int: "an integer", float: "a number",
               str: "a string", list: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings",
            list: "strings"}


def _field_specs() -> dict[str, tuple]:
    """{field name: (element type, optional, is_list, choices)} for every CLI field."""
    specs = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue
            hint = hints[f.name]
            optional = type(None) in typing.get_args(hint) or f.default is None
            specs[f.name] = (_base_type(hint), optional, bool(f.metadata.get("nargs")),
                             choices_of(f))
    return specs


def _scalar(value: Any, tp: Any) -> Any:
    """``value`` as the parser's type ``tp`` would give it from a flag; ValueError if not."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise ValueError  # a boolean is no number or string; a mapping is no scalar
    if tp is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            return int(value.strip())  # as the command line converts "2"
        raise ValueError  # 2.5 (or 2.0) is not an integer
    if tp is float:
        return float(value.strip() if isinstance(value, str) else value)
    if tp in (str, list):
        return value if isinstance(value, str) else str(value)  # as typed on the line
    return tp(value)


def coerce_value(key: str, value: Any, spec: tuple, where: str) -> Any:
    """A YAML ``value`` for field ``key`` checked and converted like its flag: the flag's
    type (strings convert as on the command line; booleans take true/false, yes/no, 1/0),
    its choices, and a list or a whitespace-separated string for multi-value flags.
    Raises ArgumentError naming the key, the value and the expected type."""
    tp, optional, is_list, choices = spec
    if value is None:
        if optional:
            return None
        raise ArgumentError(f"{where}: {key}: null is not allowed; expected "
                            f"{_TYPE_NAMES.get(tp, tp.__name__)}")
    if is_list:
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            items = [items]
        expected = f"a list (or space-separated string) of {_PLURALS.get(tp, tp.__name__)}"
    else:
        items = [value]
        expected = _TYPE_NAMES.get(tp, tp.__name__)
    try:
        out = [_scalar(v, tp) for v in items]
    except (TypeError, ValueError):
        raise ArgumentError(f"{where}: {key}: {value!r} is not valid; expected "
                            f"{expected}") from None
    if choices:
        bad = [v for v in out if v not in choices]
        if bad:
            raise ArgumentError(f"{where}: {key}: {bad[0]!r} is not one of "
                                f"{', '.join(map(str, choices))}")
    return out if is_list else out[0]


def config_from_values(values: dict[str, Any]) -> MegaliteConfig:
    """Build (and section-validate) the config from ``{field_name: value}``."""
    per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    owner = {f.name: section for section, f, _ in _fields()}
    for key, value in values.items():
        per_section[owner[key]][key] = value
    return MegaliteConfig(**{name: SECTIONS[name](**kw) for name, kw in per_section.items()})


# the model's size: Megatron's training entrypoints refuse to run without them
MODEL_SIZE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")


def parse_args(argv: Sequence[str] | None = None,
               required: Sequence[str] = ()) -> MegaliteConfig:
    """Parse Megatron-style flags (and ``--config``) into a section-validated config.

    ``required``: fields that must be given (a flag or a ``--config`` key), not left at
    their defaults. Cross-section checks need the world size: call
    ``cfg.validate(world_size)`` after.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ns, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ArgumentError(str(e)) from None
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        raise ArgumentError(f"unknown argument {flag}{_suggest(flag)}")
    cli = vars(ns)
    values = load_yaml(cli.pop("config")) if cli.get("config") else {}
    cli.pop("config", None)
    values.update(cli)
    cfg = config_from_values(values)   # the flags' own errors first
    missing = [name for name in required if values.get(name) is None]
    if missing:
        raise ConfigError(f"the model's size is not given: {', '.join(_flag(n) for n in missing)} "
                          "(Megatron-LM requires them too; megalite would otherwise train "
                          "its small default model)")
    return cfg


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def main_parse(argv: Sequence[str] | None = None) -> MegaliteConfig:
    """``parse_args`` for the training entrypoint (the model's size required): a bad flag
    prints one line and exits with code 2."""
    try:
        return parse_args(argv, required=MODEL_SIZE_FIELDS)
    except ConfigError as e:
        print(f"megalite: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
