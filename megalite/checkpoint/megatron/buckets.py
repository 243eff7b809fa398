"""The distributed optimizer's ``dp_reshardable`` state (Megatron-LM's default format for
``--use-distributed-optimizer``) -> per-parameter state, so that it imports as the
per-parameter formats do (:mod:`.optimizer`).

Megatron-Core keeps each state as one flat fp32 tensor per gradient bucket::

    [chained_<i>.]optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_<(param, grad)>
        .bucket_idx_<b>.<state>

``<state>`` being ``param`` (the fp32 main weights), ``exp_avg`` / ``exp_avg_sq`` (Adam)
or ``momentum_buffer`` (SGD), ``<m>`` the model-parallel rank whose parameters the
bucket holds, ``chained_<i>.`` the dense (0) or expert (1) optimizer where Megatron
chains two (experts at ep > 1). A bucket is that rank's parameters (their
tensor-parallel pieces) in the gradient buffer's order, each starting at a multiple of
64 elements, the gaps unused; the order is the model's parameter registration order
reversed, split into buckets by ``--ddp-bucket-size``.

Rather than rebuild Megatron's modules to know that order, each parameter is found by
its values: the ``param`` buffer holds the main weights, and the saved model weights are
those cast to the model's dtype. Every saved piece of every trained weight must be found
and every buffer walked to its end, or nothing is imported. Pieces whose values are
equal (norms never trained, say) are taken in their saved order.

Each object ``[chained_<i>.]optimizer.distributed.dp_group_idx_<m>.optimizer`` holds the
torch optimizer's ``param_groups`` with the step count.
"""

from __future__ import annotations

import math
import re

import torch

from megalite.checkpoint.files import CheckpointError

# [chained_<i>.]optimizer.distributed.dp_group_idx_<m>: one optimizer's one rank
GROUP = r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+"
KEY = re.compile(rf"(?P<bucket>{GROUP}\.gbuf_idx_\d+\.dtype_\(torch\.\w+, torch\.\w+\)"
                 r"\.bucket_idx_\d+)\.(?P<state>\w+)$")
GROUPS = re.compile(rf"{GROUP}\.optimizer$")   # the objects holding its param_groups
ALIGN = 64   # every parameter starts at a multiple of this many elements in its buffer
RESAVE = ("import the weights alone with --no-load-optim, or load the checkpoint in "
          "Megatron-LM and save it again with --dist-ckpt-optim-fully-reshardable")


def bucket_keys(keys) -> list[str]:
    """The flat per-bucket state tensors among a checkpoint's tensor keys."""
    return [k for k in keys if KEY.match(k)]


def bucket_states(keys) -> set[str]:
    """The state names (``param``, ``exp_avg``, ...) the buckets hold."""
    return {KEY.match(k)["state"] for k in bucket_keys(keys)}


def _pieces(weights: dict[str, torch.Tensor], chunks: dict[str, list]):
    """Every saved chunk of every weight: ``(key, index into the weight, sizes, flat
    values)``."""
    out = []
    for key in sorted(weights):
        w = weights[key]
        for offsets, sizes in chunks[key]:
            if math.prod(sizes) == 0:
                continue
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            out.append((key, index, tuple(sizes), w[index].reshape(-1)))
    return out


def _place(flat_param: torch.Tensor, pieces, by_first, used: set[int], where: str):
    """Walk one bucket's main weights ``flat_param`` ([numel], fp32) and return
    ``[(start, piece index, placed for the first time)]``: each piece found where its
    values are, a parameter starting at the next multiple of :data:`ALIGN` and its further
    pieces (the two halves of a gated MLP's fc1) right after the last; ``used`` (the
    pieces placed so far, in any bucket) grows."""
    placed, off, last = [], 0, None
    n = flat_param.numel()

    def match(start, candidates):
        found = None
        for i in candidates:
            key, _, _, values = pieces[i]
            end = start + values.numel()
            if end > n or not torch.equal(flat_param[start:end].to(values.dtype), values):
                continue
            if i not in used:
                return i
            found = i if found is None else found   # a duplicate (tied weights' copy)
        return found

    while off < n:
        hit = None
        if last is not None:   # a further piece of the parameter just placed
            same = [i for i in by_first.get(_first(flat_param, off, pieces[last][3]), [])
                    if pieces[i][0] == pieces[last][0] and i not in used]
            hit = match(off, same)
        if hit is None:
            off = -(-off // ALIGN) * ALIGN
            if off >= n:
                break
            hit = match(off, _candidates(flat_param, off, by_first))
        if hit is None:
            raise CheckpointError(
                f"{where}: the distributed optimizer's main weights at element {off} match no "
                f"saved weight, so its bucket layout cannot be read; {RESAVE}")
        placed.append((off, hit, hit not in used))
        used.add(hit)
        off += pieces[hit][3].numel()
        last = hit
    return placed


def _first(flat: torch.Tensor, off: int, like: torch.Tensor):
    """The index key of the element at ``off``: its value in ``like``'s dtype."""
    return (like.dtype, flat[off].to(like.dtype).item())


def _candidates(flat: torch.Tensor, off: int, by_first: dict) -> list[int]:
    """The pieces whose first value, in their dtype, is the element at ``off``."""
    out = []
    for dtype in by_first["dtypes"]:
        out += by_first.get((dtype, flat[off].to(dtype).item()), [])
    return out


def read_bucket_state(tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                      chunks: dict[str, list], where: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{state: {weight key: full fp32 tensor}}`` from the flat bucket ``tensors``
    (:func:`bucket_keys`, read whole) for the saved ``weights`` (full, the model's dtype,
    the trained ones: no buffers) whose saved ``chunks`` are each rank's pieces."""
    buckets: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        buckets.setdefault(m["bucket"], {})[m["state"]] = t
    return place_buckets(buckets, weights, chunks, where)


def place_buckets(buckets: dict[str, dict[str, torch.Tensor]], weights: dict[str, torch.Tensor],
                  chunks: dict[str, list], where: str) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`read_bucket_state` of ``buckets`` ``{bucket name: {state: flat fp32 tensor}}``
    (walked in name order; each holds ``param``, the main weights): every piece of every
    weight found by its values, or :class:`CheckpointError`."""
    pieces = _pieces(weights, chunks)
    by_first: dict = {}   # (dtype, first value) -> pieces; "dtypes": those dtypes
    for i, (_, _, _, values) in enumerate(pieces):
        by_first.setdefault((values.dtype, values[0].item()), []).append(i)
    by_first["dtypes"] = sorted({values.dtype for *_, values in pieces}, key=str)
    out: dict[str, dict[str, torch.Tensor]] = {}
    found: set[int] = set()
    for bucket, states in sorted(buckets.items()):
        if "param" not in states:
            raise CheckpointError(f"{where}: bucket {bucket} holds no main weights (param)")
        for start, i, first in _place(states["param"], pieces, by_first, found,
                                      f"{where} ({bucket})"):
            if not first:   # a second copy of a tied weight: the first one's state stands
                continue
            key, index, sizes, values = pieces[i]
            for state, flat in states.items():
                by_key = out.setdefault(state, {})
                if key not in by_key:
                    by_key[key] = torch.zeros(weights[key].shape, dtype=torch.float32)
                by_key[key][index] = flat[start:start + values.numel()].reshape(sizes)
    missing = sorted({pieces[i][0] for i in range(len(pieces)) if i not in found})
    if missing:
        raise CheckpointError(f"{where}: the distributed optimizer's buckets hold no state "
                              f"for {', '.join(missing[:3])}; {RESAVE}")
    return out


def step_count(groups: list[dict]) -> int | None:
    """The step count recorded in the ``param_groups`` of the buckets' optimizer objects
    (None: none recorded)."""
    steps = {int(g["step"]) for g in groups if "step" in g}
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer state records step counts {sorted(steps)}, "
                              "not one")
    return steps.pop() if steps else None
