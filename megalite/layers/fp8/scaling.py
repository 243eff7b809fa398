"""Per-linear fp8 scaling state, and the one place amaxes are reduced over ranks.

Each fp8 linear owns an :class:`Fp8Scaling` with three roles: the GEMM input ``x``, the
weight, and the output gradient. Its scales are layout invariant because each amax is
the maximum over exactly the ranks that hold pieces of the same logical tensor:

- **tensorwise**: every GEMM reduces its operand's amax (MAX) over the role's groups
  given by the linear: the tp group for a weight sharded over tp and for an activation
  or gradient split along its features over tp, the cp group for activations and
  gradients whose sequence is split over cp. An operand the tp ranks hold whole (the
  sequence-parallel input after its all-gather) needs no tp reduction. Micro-batches are
  scaled one by one, on any dp rank as in one process.
- **delayed**: forward and backward only record this rank's amax per role (the maximum
  over the step's micro-batches) and quantise with the scale of the history;
  :func:`finish_step`, once per optimizer step before the update, reduces every recorded
  amax (MAX) over ``ps.tp`` and then ``ps.dp_cp`` (all ranks of a pipeline stage, so all
  micro-batches of the global batch and all shards of each tensor) and pushes it into
  the history. History entry 0 is the newest. Every layout thus holds the one-process
  run's history after every step; steps before any history use scale 1.

A weight is quantised once per training step (:class:`StepWeights`): per-tensor recipes
quantise it at the step's first forward (its scale and fp8 values ``[N, K]``) and transpose
that copy once for the input-gradient GEMM (``[K, N]``); block recipes quantise it along K
(forward) and its transpose along N (input gradient); all at the step's first forward (under
ZeRO-3 the transposed copies at each backward after a gather). Every later micro-batch,
recomputed forward and backward of the step reuses them (one fp8 copy of each layout kept
through the step, not one per micro-batch in flight, and one tp reduction of a per-tensor weight
amax per step). :func:`finish_step` forgets them before the optimizer changes the weights. The
decision depends only on the step's calls, which every rank of a tp group makes alike, never on
storage addresses (which a per-layer parameter gather changes on one rank and
not another). Evaluation and inference quantise afresh every time and keep nothing.
"""

from __future__ import annotations

import torch

from megalite.layers.fp8.recipes import amax_of, block_quantize, dequant_scale, quantize
from megalite.parallel import collectives as C
from megalite.parallel.collectives import ReduceOp

INPUT, WEIGHT, GRAD = 0, 1, 2
ROLES = ("input", "weight", "grad")


class StepWeights(torch.nn.Module):
    """Quantised copies of weights kept through one training step: each is made at the
    step's first training call that asks for its key and reused by every later call of
    the step, until :meth:`forget_weight` (:func:`finish_step`, before the optimizer
    changes the weights; under ZeRO-3 also whenever the weights' unit is freed,
    :mod:`megalite.optim.param_sharding`, so that copies live only while their unit is
    gathered); outside training (``record`` False) made afresh at every call and not
    kept. ``steps``: how many steps :func:`finish_step` ended (what a copy made elsewhere
    for this step, :mod:`megalite.optim.fp8_param_gather`, is checked against).
    Subclasses: :class:`Fp8Scaling` (a linear's weight) and the routed experts'
    (:mod:`megalite.moe.fp8_experts`). No parameters or buffers (nothing in
    ``state_dict``)."""

    def __init__(self):
        super().__init__()
        self._step: dict = {}
        self.steps = 0
        # True under ZeRO-3 (set by megalite.optim.param_sharding): the copies are also
        # forgotten when their weights' unit is freed, between a micro-batch's forward and
        # its backward, so backward asks for them again instead of keeping them
        self.freed_between_passes = False

    def step_copy(self, key, record: bool, make):
        """``make()``'s result for ``key``: kept for the step when ``record`` (training)."""
        if not record:
            return make()
        if key not in self._step:
            self._step[key] = make()
        return self._step[key]

    def forget_weight(self) -> None:
        """Drop the quantised weights (the optimizer is about to change the weights, or
        their ZeRO-3 unit was freed)."""
        self._step.clear()

    def end_step(self) -> None:
        """The step is over (:func:`finish_step`): forget its copies."""
        self.forget_weight()
        self.steps += 1


class Fp8Scaling(StepWeights):
    """The scales of one linear's three operands. ``groups[role]``: the groups whose
    ranks hold pieces of that operand (tensorwise reductions; may be empty).

    Buffers (delayed only, kept out of ``state_dict``; the checkpoint stores
    ``amax_history`` itself, :mod:`megalite.checkpoint.state`): ``amax_history``
    ``[3, history_len]`` fp32, ``step_amax`` ``[3]`` fp32 (this step's local maxima)."""

    def __init__(self, recipe, groups: tuple[tuple, tuple, tuple], device=None):
        super().__init__()
        self.recipe = recipe
        self.groups = groups
        self.delayed = recipe.recipe == "delayed"
        if self.delayed:
            kw = {"dtype": torch.float32, "device": device}
            self.register_buffer("amax_history", torch.zeros(3, recipe.history_len, **kw),
                                 persistent=False)
            self.register_buffer("step_amax", torch.zeros(3, **kw), persistent=False)
        # the step's copies (StepWeights): "fp8" (scale, fp8 weight [N, K]), "fp8_t" the
        # transposed [K, N], "block_k" / "block_n" the block recipes' quantisations
        self._given = False      # "fp8" came from the fp8 parameter gather (amax recorded)

    def history_amax(self) -> torch.Tensor:
        """``[3]``: the amax each role's scale is computed from this step."""
        if self.recipe.amax_compute_algo == "max":
            return self.amax_history.amax(1)
        return self.amax_history[:, 0]

    def scale(self, role: int, x: torch.Tensor, dtype: torch.dtype, record: bool
              ) -> torch.Tensor:
        """The fp32 dequantisation scale (0-d) of operand ``x`` in ``role`` for fp8
        ``dtype``. Tensorwise: from ``x``'s amax, reduced over ``groups[role]`` (MAX;
        a collective on each of those groups). Delayed: from the history, and ``record``
        (training) keeps ``x``'s local amax for :func:`finish_step`."""
        if self.delayed:
            if record:
                self.step_amax[role] = torch.maximum(self.step_amax[role], amax_of(x))
            return dequant_scale(self.history_amax()[role], dtype, self.recipe.margin)
        amax = amax_of(x).reshape(1)
        for group in self.groups[role]:
            C.all_reduce(amax, group, ReduceOp.MAX)
        return dequant_scale(amax[0], dtype, self.recipe.margin)

    def weight_fp8(self, weight: torch.Tensor, dtype: torch.dtype, record: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(0-d fp32 dequantisation scale, fp8 values ``[N, K]``) of ``weight``: computed at
        the step's first training call (:meth:`scale`'s collectives), reused until
        :meth:`forget_weight`; afresh at every call outside training. Delayed scaling still
        records the weight's amax on a reuse (a step skipped for inf/nan gradients left
        the weights, and so this copy, as they were)."""
        if record and "fp8" in self._step:
            if self.delayed and not self._given:
                self.step_amax[WEIGHT] = torch.maximum(self.step_amax[WEIGHT],
                                                       amax_of(weight))
            return self._step["fp8"]
        d = self.scale(WEIGHT, weight, dtype, record)
        out = (d, quantize(weight, d, dtype))
        if record:
            self._step["fp8"] = out
        return out

    def weight_operands(self, weight: torch.Tensor, record: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                   torch.Tensor | None]:
        """What the fp8 GEMMs need of ``weight`` ``[N, K]``, as (dequantisation scales, fp8
        ``[N, K]`` for the forward, fp8 ``[K, N]`` for the input gradient, its scales):
        per-tensor recipes (0-d fp32 scale, ..., None: the transposed copy shares the
        scale), the step's copies :meth:`weight_fp8` and :meth:`weight_fp8_t`; block
        recipes the two of :meth:`block_weight` (scales ``[N, K / block]`` and ``[K, N /
        block]``). All made at the step's first forward. The transposed one is None where
        backward must ask for it (outside training, where nothing is kept, and when the
        copies are :attr:`freed_between_passes`). Not differentiated: the weight's
        gradient comes from the GEMMs' autograd function."""
        keep_t = record and not self.freed_between_passes
        with torch.no_grad():
            if self.recipe.block is not None:
                q, s = self.block_weight(weight, False, record)
                q_t, s_t = self.block_weight(weight, True, record) if keep_t else (None, None)
                return s, q, q_t, s_t
            d, q = self.weight_fp8(weight, self.recipe.forward_dtype, record)
            return d, q, self.weight_fp8_t(q, record) if keep_t else None, None

    def weight_fp8_t(self, qw: torch.Tensor, record: bool) -> torch.Tensor:
        """``qw`` ``[N, K]`` (the fp8 weight :meth:`weight_fp8` gave this call's forward)
        transposed to a row-major ``[K, N]``, the input-gradient GEMM's operand: made once
        per step (at its first forward, or under ZeRO-3 at the first backward after each
        gather) and reused by the step's later calls (the step's fp8 weight does not change
        within the step); afresh outside training."""
        return self.step_copy("fp8_t", record, lambda: qw.t().contiguous())

    def block_weight(self, weight: torch.Tensor, transposed: bool, record: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block recipes: ``weight`` ``[N, K]`` block-quantised along K (``[N, K]`` values,
        ``[N, K / block]`` scales; the forward's operand) or, ``transposed``, ``weight^T``
        along N (``[K, N]``, ``[K, N / block]``; the input gradient's), in the forward
        dtype; each kept for the step like :meth:`weight_fp8` (no amax to record)."""
        recipe = self.recipe

        def make():
            w = weight.t() if transposed else weight
            return block_quantize(w, recipe.block, recipe.forward_dtype,
                                  mx=recipe.recipe == "mxfp8")

        return self.step_copy("block_n" if transposed else "block_k", record, make)

    def give_weight(self, d: torch.Tensor, q: torch.Tensor) -> None:
        """Use ``(d, q)`` (0-d fp32 dequantisation scale, fp8 weight in the weight's shape)
        as this step's fp8 weight: ``--fp8-param-gather`` quantised it on the ranks owning
        its shards with this scaling's scale (:mod:`megalite.optim.fp8_param_gather`),
        which also recorded the weight's amax under delayed scaling. The step's
        transposed copy is made from it with the step's first forward, like the scaling's
        own."""
        self._step["fp8"], self._given = (d, q), True

    def forget_weight(self) -> None:
        super().forget_weight()
        self._given = False

    def push(self, amax: torch.Tensor) -> None:
        """Shift the history by one step and put ``amax`` ``[3]`` first; clear the step
        (and its fp8 weights, whose scale came from the old history)."""
        self.forget_weight()
        self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=1))
        self.amax_history[:, 0] = amax
        self.step_amax.zero_()


def delayed_scalings(model_chunks) -> list[tuple[str, Fp8Scaling]]:
    """(module name, scaling) of every delayed-scaling linear in ``model_chunks``, in
    module order (the same order on every rank of a pipeline stage)."""
    out = []
    for i, chunk in enumerate(model_chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, Fp8Scaling) and module.delayed:
                out.append((f"{i}.{name}", module))
    return out


@torch.no_grad()
def finish_step(model_chunks, ps) -> None:
    """End of a step, before the optimizer step: every :class:`StepWeights` in
    ``model_chunks`` forgets the step's quantised weights; under delayed scaling, reduce
    the step's amaxes of all linears (one MAX all-reduce over ``ps.tp``, then one over
    ``ps.dp_cp``) and push them into the histories."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, StepWeights):
                module.end_step()
    scalings = [s for _, s in delayed_scalings(model_chunks)]
    if not scalings:
        return
    amax = torch.stack([s.step_amax for s in scalings])
    C.all_reduce(amax, ps.tp, ReduceOp.MAX)
    C.all_reduce(amax, ps.dp_cp, ReduceOp.MAX)
    push_all(scalings, amax)


def push_all(scalings: list[Fp8Scaling], amax: torch.Tensor) -> None:
    """:meth:`Fp8Scaling.push` of ``amax[i]`` (``[L, 3]``) into ``scalings[i]`` for all L at
    once: the histories shifted in one stacked copy and written back and the step's
    amaxes cleared by multi-tensor kernels (a handful of launches a step instead of
    several per linear); the same values as pushing one by one. Histories of different
    lengths or devices are pushed one by one."""
    histories = [s.amax_history for s in scalings]
    if len({(h.shape, h.device) for h in histories}) != 1:
        for s, a in zip(scalings, amax):
            s.push(a)
        return
    for s in scalings:
        s.forget_weight()
    stacked = torch.stack(histories)                             # [L, 3, history_len]
    shifted = torch.cat([amax.to(stacked.dtype).unsqueeze(-1), stacked[..., :-1]], -1)
    torch._foreach_copy_(histories, list(shifted.unbind(0)))
    torch._foreach_zero_([s.step_amax for s in scalings])
