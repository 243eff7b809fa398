"""Which layers are MoE layers: Megatron's ``--moe-layer-freq``, an integer (every n-th
layer from layer 0) or a Python list expression of one 0/1 per layer (``"[0]*3+[1]*58"``),
read without ``eval``."""

from __future__ import annotations

import ast
import functools

from megalite.config.fields import ConfigError, require

MAX_LAYERS = 100_000   # a repeat count past this is refused before the list is built


def _layer_list(text: str) -> list:
    """The value of Megatron's ``--moe-layer-freq`` list expression (``"[0]*3+[1]*58"``):
    list literals of integers joined by ``+`` and repeated by ``*``, evaluated without
    ``eval``. ValueError for anything else."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            counts = [abs(x) for x in (left, right) if isinstance(x, int)]
            if isinstance(node.op, ast.Mult) and counts and max(counts) > MAX_LAYERS:
                raise ValueError(text)   # "[0]*10000000000": no model has that many layers
            try:
                return left + right if isinstance(node.op, ast.Add) else left * right
            except TypeError:
                raise ValueError(text) from None
        raise ValueError(text)

    try:
        out = value(ast.parse(text.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(text) from None
    if not isinstance(out, list):
        raise ValueError(text)
    return out


@functools.lru_cache(maxsize=256)
def moe_layer_pattern_of(freq: int | str, num_layers: int) -> tuple[bool, ...]:
    """Which of ``num_layers`` layers (0-based, global) are MoE layers for a normalized
    ``--moe-layer-freq``: every ``freq``-th from layer 0 (an int), or the 0/1 per layer of
    a list expression (a str). Raises ConfigError naming what is wrong."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    try:
        flags = _layer_list(freq)
    except ValueError:
        raise ConfigError(f"--moe-layer-freq {freq!r} is neither an integer nor a list "
                          "expression of 0/1 per layer such as \"[0]*3+[1]*58\"") from None
    require(all(type(f) is int and f in (0, 1) for f in flags),
            f"--moe-layer-freq {freq!r} must list only 0 (dense) and 1 (MoE) per layer")
    require(len(flags) == num_layers,
            f"--moe-layer-freq {freq!r} lists {len(flags)} layers but the model has "
            f"num_layers {num_layers}; give one 0/1 per layer")
    return tuple(bool(f) for f in flags)


def normalized_freq(freq) -> int | str:
    """``--moe-layer-freq`` as an int (``2``, ``"2"``) or a stripped list expression."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        return freq
    if isinstance(freq, (list, tuple)):  # a Megatron args namespace holds the list
        return "[" + ",".join(str(int(f)) for f in freq) + "]"
    text = str(freq).strip()
    try:
        return int(text)
    except ValueError:
        return text
