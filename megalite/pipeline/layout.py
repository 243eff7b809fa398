"""Which transformer layers each pipeline stage and virtual chunk holds.

With ``p`` pipeline stages and ``v`` virtual chunks per stage, the model is cut into
``p * v`` consecutive pieces laid out round-robin, as in Megatron-LM's interleaved
schedule: piece ``c * p + r`` (chunk ``c`` of stage ``r``) holds the layers after pieces
``0 .. c*p + r - 1``. Stage ``r`` holds ``n_r`` layers (equal by default; the first and last
stage may differ with ``--decoder-first/last-pipeline-num-layers``), split equally over
its ``v`` chunks.
"""

from __future__ import annotations

import torch

from megalite.config import ConfigError


def model_chunks(model) -> list[torch.nn.Module]:
    """This rank's pipeline chunks: the items of a ModuleList / list / tuple of chunks
    (what ``training.build`` makes under pipeline parallelism), or the one module."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):
        return list(model)
    return [model]


def layers_per_stage(num_layers: int, pp: int, first: int | None = None,
                     last: int | None = None) -> list[int]:
    """Number of layers of each pipeline stage, [n_0, ..., n_{p-1}]."""
    if pp == 1:
        return [num_layers]
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = num_layers - sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    if rest < 0 or (free and rest % len(free)) or (not free and rest):
        raise ConfigError(f"cannot split {num_layers} layers over {pp} pipeline stages with "
                          f"first={first}, last={last}: the remaining layers must divide "
                          "evenly over the other stages")
    for i in free:
        counts[i] = rest // len(free)
    return counts  # type: ignore[return-value]


def chunk_layer_ranges(num_layers: int, pp: int, vpp: int | None = None,
                       first: int | None = None, last: int | None = None
                       ) -> list[list[tuple[int, int]]]:
    """Global layer ranges ``ranges[stage][chunk] = (first_layer, num_layers)``.

    ``first_layer`` is 0-based and global, so a layer's number (and so its initial weights
    and checkpoint name) does not depend on the layout.
    """
    v = vpp or 1
    per_stage = layers_per_stage(num_layers, pp, first, last)
    for r, n in enumerate(per_stage):
        if n % v:
            raise ConfigError(f"pipeline stage {r} has {n} layers, not divisible by the "
                              f"{v} virtual pipeline chunks")
    ranges: list[list[tuple[int, int]]] = [[(0, 0)] * v for _ in range(pp)]
    start = 0
    for c in range(v):
        for r in range(pp):
            n = per_stage[r] // v
            ranges[r][c] = (start, n)
            start += n
    return ranges
