"""Newton-Schulz orthogonalisation, Muon's core: ``X -> U V^T`` (approximately) for
``X = U S V^T``, by an odd matrix polynomial applied a few times.

One step on ``X`` ``[m, n]`` (``m <= n``, so that the Gram matrix is the small one)::

    A = X X^T                  [m, m]
    X <- a X + (b A + c A A) X

after ``X`` was divided by its Frobenius norm (so every singular value is at most 1).
Each step maps every singular value ``s`` to ``a s + b s^3 + c s^5`` and leaves the
singular vectors alone, which is why orthogonalising ``X^T`` gives the transpose of the
result, and orthogonalising ``P X`` (rows permuted) gives ``P`` times it. A tall ``X``
(``m > n``) takes the same step on its transpose, written without transposing anything
(``A`` and the polynomial are symmetric)::

    A = X^T X                  [n, n]
    X <- a X + X (b A + c A A)

Coefficient sets (``--muon-coefficient-type``), with the meanings of Megatron-LM's flag
(the tables of NVIDIA's Emerging-Optimizers, which Megatron-LM calls):

- ``simple``: one triple, (3.4445, -4.7750, 2.0315), every step (K. Jordan's Muon: the
  quintic whose slope at 0 is maximised; singular values end in a band around 1, roughly
  [0.7, 1.2], not at 1);
- ``quintic``: five triples, one per step (tuned per iteration, as in modded-nanogpt),
  repeated when ``--muon-num-ns-steps`` is a multiple of 5 above it;
- ``polar_express``: the eight per-iteration triples of the Polar Express method (Amsel,
  Persson, Musco and Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
  Application to the Muon Algorithm", 2025), at least 8 steps, the last triple repeated
  beyond 8; it converges towards 1 much more tightly.

Distributed (``--muon-tp-mode distributed``): when the columns of ``X`` are split over a
group of ranks, ``X X^T`` and the norm are sums over the column blocks, so one all-reduce
per step (``[m, m]``, SUM over the group) lets every rank advance its own columns.
"""

from __future__ import annotations

import contextlib
import math

import torch

from megalite.parallel import collectives

EPS = 1e-7

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
}
COEFFICIENT_TYPES = tuple(COEFFICIENTS)


def steps_problem(kind: str, steps: int) -> str | None:
    """Why ``steps`` Newton-Schulz steps do not fit coefficient set ``kind`` (None: fine)."""
    n = len(COEFFICIENTS[kind])
    if steps < 1:
        return f"--muon-num-ns-steps must be at least 1, got {steps}"
    if kind == "quintic" and steps % n:
        return (f"--muon-coefficient-type quintic has {n} per-step coefficient sets, so "
                f"--muon-num-ns-steps must be a multiple of {n}; got {steps}")
    if kind == "polar_express" and steps < n:
        return (f"--muon-coefficient-type polar_express has {n} per-step coefficient sets, "
                f"so --muon-num-ns-steps must be at least {n}; got {steps}")
    return None


def coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` steps."""
    problem = steps_problem(kind, steps)
    if problem:
        raise ValueError(problem)
    table = list(COEFFICIENTS[kind])
    if kind == "polar_express":
        return table + [table[-1]] * (steps - len(table))
    return (table * math.ceil(steps / len(table)))[:steps]


# --muon-fp32-matmul-prec on a GPU, Megatron-LM's meanings: ``high`` runs the iteration's
# fp32 matmuls as TF32; ``medium`` (and ``low``, which torch does not name) asks for fp32
# matmuls with bf16 inside, which CUDA does not have (torch's "medium" is TF32 there), so
# the iteration runs on a bf16 copy of X, as NVIDIA's Emerging-Optimizers does
ITERATION_DTYPE = {"low": torch.bfloat16, "medium": torch.bfloat16, "high": torch.float32}


def iteration_dtype(x: torch.Tensor, precision: str | None) -> torch.dtype:
    """The dtype the iteration's matmuls take for ``precision`` (``--muon-fp32-matmul-prec``)
    on ``x``'s device: fp32 on the CPU (IEEE, so that the CPU runs and the layout tests that
    compare them stay exact) and with ``precision`` None; on a GPU :data:`ITERATION_DTYPE`."""
    if precision is None or x.device.type != "cuda":
        return torch.float32
    return ITERATION_DTYPE[precision]


@contextlib.contextmanager
def matmul_precision(x: torch.Tensor, precision: str | None):
    """On a GPU with ``precision`` ``high``, the fp32 matmuls in TF32 (torch's ``high``);
    nothing changes elsewhere. torch's global setting is restored on exit."""
    if precision != "high" or x.device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(x: torch.Tensor, steps: int, kind: str = "quintic",
                  group=None, precision: str | None = None) -> torch.Tensor:
    """Orthogonalise ``x`` ``[..., m, n]`` (fp32; a batch of matrices) along its last two
    dimensions, as given (no transpose: pass ``m <= n`` for the cheap side); fp32 out.
    ``precision`` (``--muon-fp32-matmul-prec``) sets the matmuls' dtype on a GPU
    (:func:`iteration_dtype`, :func:`matmul_precision`).

    ``group`` (a :class:`~megalite.parallel.state.Group`, or None): ``x`` holds this rank's
    columns of each matrix; the squared norms ``[...]`` and the Gram matrices
    ``[..., m, m]`` are all-reduced in fp32 (SUM) over ``group`` (collective over it)."""
    with matmul_precision(x, precision):
        return iterate(x, steps, kind, group, iteration_dtype(x, precision))


def normalize(x: torch.Tensor, group=None, out: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` ``[..., m, n]`` (fp32, any strides) divided by each matrix's Frobenius norm,
    written in ``dtype``, or into ``out`` (``[..., m, n]`` of the iteration's dtype: one
    pass that reads fp32 and writes, say, bf16). The squared norm is summed in fp32 as the
    rows' squared norms (one reduction pass over ``x``, no squared copy of it), then their
    sum: on the CPU one reduction over both dimensions splits its work (and its float
    rounding) by the size of the batch, these two do not, so a matrix normalised alone or
    in a stack gives the same bits. ``group``: ``x`` holds this rank's columns; the
    squared norms ``[..., 1, 1]`` are all-reduced (SUM) over it."""
    rows = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    sq = rows.square().sum(dim=-2, keepdim=True)
    if group is not None:
        collectives.all_reduce(sq, group)
    norm = sq.sqrt().clamp_min(EPS)
    if out is not None:
        return torch.div(x, norm, out=out)
    return (x / norm).to(dtype)


def polynomial_steps(x: torch.Tensor, steps: int, kind: str, group=None,
                     right: bool = False) -> torch.Tensor:
    """The ``steps`` polynomial steps on normalised ``x`` ``[m, n]`` or ``[B, m, n]``, in
    ``x``'s dtype: each step's two products with a scaled addend are single ``addmm`` /
    ``baddbmm`` calls, whose fp32 epilogue rounds a bf16 result once. ``right``: the
    tall form (``A = X^T X`` ``[..., n, n]``, ``X <- a X + X P``; module docstring).
    ``group``: as in :func:`normalize`, the Gram matrices ``[..., m, m]`` all-reduced in
    fp32 (SUM)."""
    dtype = x.dtype
    add_product = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in coefficients(kind, steps):
        gram = x.mT @ x if right else x @ x.mT
        if group is not None:       # partial sums over the column blocks, added in fp32
            gram = gram.float()
            collectives.all_reduce(gram, group)
            gram = gram.to(dtype)
        poly = add_product(gram, gram, gram, beta=b, alpha=c)       # b A + c A A
        x = add_product(x, x, poly, beta=a) if right \
            else add_product(x, poly, x, beta=a)                    # a X + poly X
    return x


def iterate(x: torch.Tensor, steps: int, kind: str, group=None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The iteration of :func:`newton_schulz` with its matmuls in ``dtype`` (fp32 or
    bf16): :func:`normalize` into ``dtype``, then :func:`polynomial_steps`. Returns fp32
    ``[..., m, n]``."""
    shape = x.shape
    x = x.reshape(-1, *shape[-2:]) if x.dim() > 3 else x
    x = polynomial_steps(normalize(x, group, dtype=dtype), steps, kind, group)
    return x.float().reshape(shape)


def orthogonalize_stack(views: list[torch.Tensor], steps: int, kind: str,
                        precision: str | None = None) -> torch.Tensor:
    """Whole matrices ``views`` (each ``[k_i, m, n]``, fp32, of one ``(m, n)``)
    normalised straight into one ``[sum k_i, m, n]`` stack of the iteration's dtype
    (:func:`iteration_dtype`: bf16 for ``precision`` ``medium`` on a GPU) and iterated
    together, on the side of the smaller Gram matrix (the tall form when ``m > n``: no
    transposed copy anywhere). Returns the stack in that dtype (the caller scales each
    part out of it). On the CPU a view's result is bitwise the same alone or stacked
    with others. No collectives."""
    first = views[0]
    dtype = iteration_dtype(first, precision)
    stack = torch.empty((sum(v.shape[0] for v in views), *first.shape[-2:]), dtype=dtype,
                        device=first.device)
    offset = 0
    for v in views:
        normalize(v, out=stack[offset:offset + v.shape[0]])
        offset += v.shape[0]
    with matmul_precision(first, precision):
        return polynomial_steps(stack, steps, kind, right=stack.shape[-2] > stack.shape[-1])


def orthogonalize(x: torch.Tensor, steps: int, kind: str = "quintic",
                  precision: str | None = None) -> torch.Tensor:
    """Whole matrices ``x`` ``[..., m, n]`` orthogonalised on one rank, on the side with
    the smaller Gram matrix, as :func:`megalite.optim.muon_layout.orthogonalize_batched`
    does for a stack of such matrices (:func:`orthogonalize_stack`), so that the result
    does not depend on being batched; fp32 out."""
    o = orthogonalize_stack([x.reshape(-1, *x.shape[-2:])], steps, kind, precision)
    return o.float().reshape(x.shape)


def scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """The factor the orthogonalised update of an ``[out, in]`` matrix is multiplied by
    (``--muon-scale-mode``, Megatron-LM's meanings): ``spectral`` sqrt(max(out, in))
    (Moonlight's, matching AdamW's update RMS with --muon-extra-scale-factor 0.2),
    ``unit_rms_norm`` sqrt(out / in), ``shape_scaling`` sqrt(max(1, out / in)) (Jordan)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    raise ValueError(f"unknown --muon-scale-mode {mode!r}")


def ns_flops(m: int, n: int, steps: int) -> float:
    """Multiply-add FLOPs of ``steps`` steps on an ``[m, n]`` matrix (``m <= n`` after the
    transpose): ``X X^T``, ``A A`` and ``B X`` per step."""
    m, n = min(m, n), max(m, n)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)
