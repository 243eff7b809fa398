"""One fuzz draw against the single-process run: train both, compare, list what differs.

The drawn layout trains ``ITERS`` iterations on pooled gloo ranks; the reference trains
the same model (same seed, data flags, global batch, optimizer) in this process, at world 1,
without recomputation and with the default dispatcher and cp comm type (none of them
changes the model's math).
Compared, on every rank:

* ``lm_loss`` of every iteration (the global-batch token mean, reported by every rank)
  and ``grad_norm`` (the global norm before clipping, from the metrics file of the logging
  rank): the norm sees a gradient off by a constant factor even where AdamW and clipping
  would hide it from the parameters; with ``--qk-clip`` / ``--log-max-attention-logit``
  also the logged ``max_attention_logit`` (the maximum over the global batch, all layers
  and heads), at the grad norm's relative tolerance;
* every parameter the rank holds after the last step, gathered to its full shape
  (``full_state_dict`` of each model chunk: over tp, and for experts over etp and ep),
  against the reference; a tied output layer (pp > 1) and the prediction depths' copy
  under a V schedule (``mtp_embedding``) against the word embedding.
  Together the ranks must hold every parameter of the reference.

Tolerances (absolute, on losses about 4 and parameters about 0.02-1):

* fp32: loss 2e-5 + 1e-5 relative, grad norm 1e-4 relative, parameters 5e-5 -- the
  equivalence suites' matrix tolerances; layouts only reorder fp32 sums (observed over
  260 draws: loss <= 5e-7, grad norm <= 2e-7 relative, parameters <= 1e-5).
* bf16 (both runs in bf16 with fp32 master weights): loss 1e-2, grad norm 5e-2 relative,
  parameters 1e-2 + 2^-6 relative. bf16 keeps 8 bits of mantissa: a reordered sum differs
  by ~4e-3 relative, a router may pick another expert for a token near a tie, a norm
  weight near 1 moves by one ulp (2^-7) when its fp32 master crosses a rounding boundary,
  and AdamW turns tiny gradient differences into steps of up to ``lr`` (3e-3) per
  iteration (observed over 109 draws: loss <= 2.4e-3, grad norm <= 6e-3 relative,
  parameters <= 7.8e-3). The planted bugs listed in test_layout_fuzz.py moved bf16 draws by a
  grad norm off by a factor of 2 to 4 or a loss off by 5e-2 within the 3 steps.
* fp8 GEMMs in fp32 (``--fp8-format``; with ``--bf16`` the bf16 tolerances): the first
  iteration at the fp32 tolerances (loss 2e-5, grad norm 1e-4 relative: same parameters,
  and the scales must match), later ones at loss 1e-3, grad norm 1e-2 relative,
  parameters 8e-3. A reordered fp32 sum moves an operand by ~1e-7 relative, and the few
  elements that sit on an fp8 rounding boundary then round one fp8 step (2^-3 relative)
  apart, or flush to 0 or not; AdamW's first steps are about ``lr`` x sign(gradient), so a
  gradient element near 0 that changes sign (or becomes 0) moves its parameter by up to
  2 x lr = 6e-3. Only tensor parallelism reorders the forward's sums, and there the
  iterations after such a step differ: over the 46 fp8 draws of seeds 0-407 and 509, the
  tp > 1 ones reached loss 4.9e-4 (seed 509, e4m3 gradients), grad norm 3.6e-3 relative
  (seed 343) and parameters 4.7e-3 at iteration 3, with the first two iterations' losses
  equal to the last bit; the others stayed within 3e-5. A tp weight amax left unreduced
  moved the first iteration's grad norm by 1.7e-3 relative; amaxes of delayed scaling
  left unreduced over dp show in the histories (tests/fp8/test_checkpoint.py compares them
  with one process at 1e-5). With routed experts (fp8 GEMMs there too) later iterations at
  loss 2e-3: once the parameters differ by those steps, a token near a routing tie takes
  another expert (observed: loss 7.5e-4 at iteration 3, mxfp8 at tp2 + sp); the first
  iteration, where the scales must match, keeps the fp32 tolerances. Such a token moves
  the aux-loss-free expert biases by whole steps: each update adds
  ``rate x sign(mean load - load)``, so one token on another expert changes an expert's
  sign by up to 2. fp8 draws with routed experts allow ``2 x rate`` per iteration in the
  ``expert_bias`` buffers (seed 229, tp2 + sp, etp2, e4m3 tensorwise, one MTP depth: the
  depth's four biases one step of 0.05 apart after 3 iterations in bf16, its losses within
  7.6e-4; in fp32, without fp8 or without the depth it matches, the first iteration at the
  fp32 tolerances), in bf16 too; other draws compare them at the parameter tolerances,
  which a bias update left unreduced over dp breaks.
* Lion (``--optimizer lion``, or Muon's ``--muon-scalar-optimizer lion``; fp32 draws
  only): the fp32 tolerances, except that up to a ten-thousandth of a tensor's elements
  (at least one) may differ by up to ``2 x iterations x lr``. Lion steps every element by
  ``lr`` times the sign of a momentum, and an element whose momentum is a rounding away
  from 0 takes the other sign in another layout (seed 388, tp2 x pp2 x vpp4 x ep2: 1 and
  4 of 131072 expert elements, 0.0033 and 0.006 apart, the losses equal). A gradient off
  by any factor still moves the other elements' signs or the grad norm.
* Parameters whose gradient is zero in exact arithmetic (:data:`ZERO_GRADIENT`: the key
  norm's bias under ``--qk-layernorm`` with LayerNorm, which adds the same ``q . b`` to
  every logit of a query's row, and the softmax ignores that) get only the rounding noise
  of the layout's sums, which AdamW normalises into steps of up to ``lr`` each: they may
  differ by up to ``iterations x lr`` (seed 1795771944, tp2 + sp x cp2, Muon with its
  AdamW: 1 of 16 elements 6.3e-5 apart, everything else within the fp32 tolerances). A
  gradient that is not zero there shows in the grad norm.
"""

from __future__ import annotations

import dataclasses

from megalite.config.optim import uses_lion
from tests.layouts import Layout, tiny

ITERS = 3
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
MTP_COPY = "mtp_embedding.word_embeddings.weight"   # V schedule: the depths' copy
# recomputation, activation offload, the dispatcher and the cp comm type do not change the
# model: the reference runs without
# optimizer CPU offload neither (and needs a sharded optimizer, which one process lacks)
# and Muon's tp mode has nothing to split there
OPTIM_DROPS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "muon_tp_mode")
REFERENCE_DROPS = ("recompute_granularity", "recompute_method", "recompute_num_layers",
                   "recompute_modules", "moe_token_dispatcher_type", "cp_comm_type",
                   "cpu_offloading", "cpu_offloading_num_layers", "fp8_param_gather")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    loss_abs: float
    loss_rel: float
    norm_rel: float
    param_abs: float
    param_rel: float = 0.0
    first_loss_abs: float | None = None   # iteration 1, where tighter (fp8)
    first_norm_rel: float | None = None
    bias_steps: int = 0    # expert_bias may differ by this many update steps (fp8 + MoE)
    # Lion: up to this fraction of a tensor's elements (at least one) may differ by up to
    # sign_step, the other elements at the parameter tolerances
    sign_fraction: float = 0.0
    sign_step: float = 0.0


FP32 = Tolerance(loss_abs=2e-5, loss_rel=1e-5, norm_rel=1e-4, param_abs=5e-5)
BF16 = Tolerance(loss_abs=1e-2, loss_rel=0.0, norm_rel=5e-2, param_abs=1e-2,
                 param_rel=2 ** -6)
FP8 = Tolerance(loss_abs=1e-3, loss_rel=0.0, norm_rel=1e-2, param_abs=8e-3,
                first_loss_abs=FP32.loss_abs, first_norm_rel=FP32.norm_rel)
FP8_MOE = dataclasses.replace(FP8, loss_abs=2e-3, bias_steps=2 * ITERS)


LION_SIGN_FRACTION = 1e-4
# parameters whose gradient is zero in exact arithmetic (module docstring)
ZERO_GRADIENT = ("self_attention.k_layernorm.bias",)


def tolerance(layout: Layout) -> Tolerance:
    fp8, moe = layout.model.get("fp8_format"), layout.model.get("num_experts")
    optim = tiny(layout).optim
    if uses_lion(optim.optimizer, optim.muon_scalar_optimizer):
        return dataclasses.replace(FP32, sign_fraction=LION_SIGN_FRACTION,
                                   sign_step=2 * ITERS * optim.lr)
    if layout.model.get("bf16"):
        return dataclasses.replace(BF16, bias_steps=2 * ITERS) if fp8 and moe else BF16
    if fp8:
        return FP8_MOE if moe else FP8
    return FP32


def config(layout: Layout, metrics_jsonl: str | None = None):
    """The run's validated config, with ``vocab_size`` the NullTokenizer's (``--vocab-size``
    + 1, its eod), as a default build would set it."""
    from megalite.data.tokenizers import build_tokenizer

    cfg = tiny(layout, train={"train_iters": ITERS}, logging={"metrics_jsonl": metrics_jsonl})
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    return cfg


_DATASETS: dict[tuple, tuple] = {}


def datasets(cfg, tokenizer=None) -> tuple:
    """A ``datasets_provider`` that builds the mock datasets once per process and batch
    (their indices cost more than training the tiny model), with the NullTokenizer whose
    vocabulary is the model's (its eod, ``vocab_size - 1``, is a valid label)."""
    from megalite.data.tokenizers import build_tokenizer
    from megalite.training.build import default_datasets_provider

    t = cfg.train
    key = (cfg.model.seq_length, cfg.model.vocab_size, t.seed, t.global_batch_size,
           t.train_iters, repr(cfg.data))
    if key not in _DATASETS:
        tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size - 1)
        assert tok.vocab_size == cfg.model.vocab_size and tok.eod < cfg.model.vocab_size
        _DATASETS[key] = default_datasets_provider(cfg, tok)
    return _DATASETS[key]


def reference_layout(layout: Layout) -> Layout:
    """The single-process run of ``layout``'s model, optimizer and batch."""
    model = {k: v for k, v in layout.model.items() if k not in REFERENCE_DROPS}
    return Layout("reference", 1, model=model, train=dict(layout.train),
                  optim={k: v for k, v in layout.optim.items() if k not in OPTIM_DROPS},
                  data=dict(layout.data))


def train_and_gather(layout: Layout) -> tuple[dict, dict, dict]:
    """Train ``layout`` in this process's world; (iteration -> lm_loss, name -> full
    parameter of every chunk this rank holds, iteration -> grad_norm if this rank logs
    metrics, else empty; that dict also maps ``("max_attention_logit", iteration)`` when
    it is logged). Collective over the whole world."""
    import os
    import tempfile

    from megalite.parallel.state import ParallelState
    from megalite.pipeline.layout import model_chunks
    from megalite.training.build import build_components
    from megalite.training.loop import train
    from tests.training.common import read_jsonl

    with tempfile.TemporaryDirectory(prefix="megalite-fuzz-") as tmp:
        jsonl = os.path.join(tmp, "metrics.jsonl")
        cfg = config(layout, metrics_jsonl=jsonl)
        ps = ParallelState.build(cfg.parallel)
        try:
            c = build_components(cfg, ps, datasets_provider=datasets, peak_probe_seconds=0.01)
            try:
                result = train(c)
                c.grads.finish_param_sync()   # --overlap-param-gather: the last step's params
                params = {}
                for chunk in model_chunks(c.model):
                    params.update(chunk.full_state_dict())   # collective over tp, etp, ep
            finally:
                c.close()
        finally:
            ps.destroy()
        rows = read_jsonl(jsonl) if os.path.exists(jsonl) else []   # the logging rank's
    norms = {row["iteration"]: row["grad_norm"] for row in rows if "grad_norm" in row}
    norms.update({("max_attention_logit", row["iteration"]): row["max_attention_logit"]
                  for row in rows if "max_attention_logit" in row})
    return result.losses, params, norms


def rank_body(rank: int, world_size: int, layout: Layout) -> tuple[dict, dict, dict]:
    assert world_size == layout.world_size, (world_size, layout.world_size)
    return train_and_gather(layout)


_REFERENCES: dict[str, tuple[dict, dict, dict]] = {}


def reference(layout: Layout) -> tuple[dict, dict, dict]:
    """The single-process run (cached per model and batch for the session)."""
    ref = reference_layout(layout)
    key = repr(ref)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_and_gather(ref)
    return _REFERENCES[key]


def compare(layout: Layout, ranks: list[tuple[dict, dict, dict]],
            ref: tuple[dict, dict, dict]) -> list[str]:
    """Differences between every rank's (losses, params, grad norms) and the reference's."""
    tol, (ref_losses, ref_params, ref_norms) = tolerance(layout), ref
    tied = not layout.model.get("untie_embeddings_and_output_weights", False)
    zero_gradient_steps = ITERS * tiny(layout).optim.lr   # AdamW's largest steps
    problems, seen = [], set()
    if not any(norms for _, _, norms in ranks):
        problems.append("no rank logged grad_norm")
    for rank, (losses, params, norms) in enumerate(ranks):
        for it, want in ref_norms.items() if norms else ():
            got = norms.get(it, float("nan"))
            rel = tol.first_norm_rel if it == 1 and tol.first_norm_rel else tol.norm_rel
            if not abs(got - want) <= rel * abs(want):
                what, at = ("grad_norm", it) if isinstance(it, int) else it
                problems.append(f"rank {rank}: {what} at iteration {at}: {got:.7g} vs "
                                f"{want:.7g}")
        if list(losses) != list(ref_losses):
            problems.append(f"rank {rank}: iterations {list(losses)} vs {list(ref_losses)}")
        for it, want in ref_losses.items():
            got = losses.get(it, float("nan"))
            absolute = tol.first_loss_abs if it == 1 and tol.first_loss_abs else tol.loss_abs
            if not abs(got - want) <= absolute + tol.loss_rel * abs(want):
                problems.append(f"rank {rank}: lm_loss at iteration {it}: {got:.7g} vs "
                                f"{want:.7g} (diff {got - want:.3g})")
        for name, tensor in params.items():
            copy = (name == OUTPUT and tied and OUTPUT not in ref_params) or name == MTP_COPY
            key = EMBEDDING if copy else name
            want = ref_params.get(key)
            seen.add(key)
            if want is None or want.shape != tensor.shape:
                problems.append(f"rank {rank}: {name} {tuple(tensor.shape)} vs "
                                f"{None if want is None else tuple(want.shape)}")
                continue
            diff = (tensor.float() - want.float()).abs()
            allowed = tol.param_abs + tol.param_rel * want.float().abs()
            if name.endswith("router.expert_bias") and tol.bias_steps:
                rate = layout.model.get("moe_router_bias_update_rate", 1e-3)
                allowed = allowed + tol.bias_steps * rate
            if name.endswith(ZERO_GRADIENT):
                allowed = allowed + zero_gradient_steps
            bad = ~(diff <= allowed)
            if bad.any() and tol.sign_step:
                flipped = bad & (diff <= tol.sign_step)
                if int(flipped.sum()) <= max(1, tol.sign_fraction * diff.numel()):
                    bad &= ~flipped
            if bad.any():
                problems.append(f"rank {rank}: {name} max diff {diff.max().item():.3g} "
                                f"({int(bad.sum())} of {diff.numel()} elements)")
    missing = set(ref_params) - seen
    if missing:
        problems.append(f"no rank holds {sorted(missing)}")
    return problems


def max_differences(ranks: list[tuple[dict, dict, dict]], ref: tuple[dict, dict, dict]
                    ) -> tuple:
    """(largest loss difference, largest relative grad-norm difference, largest parameter
    difference) over every rank: how far inside the tolerance a draw stays."""
    ref_losses, ref_params, ref_norms = ref
    loss = max(abs(losses.get(it, float("nan")) - want) for losses, _, _ in ranks
               for it, want in ref_losses.items())
    norm = max((abs(norms.get(it, float("nan")) - want) / abs(want) for _, _, norms in ranks
                if norms for it, want in ref_norms.items()), default=float("nan"))
    param = max(((t.float() - ref_params[n].float()).abs().max().item()
                 for _, params, _ in ranks for n, t in params.items()
                 if n in ref_params and ref_params[n].shape == t.shape), default=0.0)
    return loss, norm, param


def check(layout: Layout) -> tuple[list[str], tuple]:
    """Run ``layout`` on pooled ranks and its reference here; (problems, max diffs)."""
    from tests.distributed.harness import run_distributed

    ranks = run_distributed(layout.world_size, rank_body, layout)
    ref = reference(layout)
    return compare(layout, ranks, ref), max_differences(ranks, ref)
