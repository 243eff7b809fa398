"""The resolved layout: every size and count a validated config implies for a world of
ranks, derived once, in one frozen object that the builder, the dry run, the planner, the
pipeline schedules and the benchmarks read.

    layout = cfg.resolve(world_size)          # MegaliteConfig: validate, then resolve
    layout.dp, layout.num_microbatches, layout.stage_chunks[pp_rank]
    layout = layout.with_vocab(tokenizer.vocab_size)   # once the vocabulary is known

Sizes: ``tp cp pp vpp dp`` for the dense part (``world = tp x cp x dp x pp``; ``vpp`` is 1
without virtual chunks) and ``ep etp edp`` for the experts (``tp x cp x dp = etp x ep x
edp``). Batches: micro-batches per step of the final global batch, and of every step of a
batch-size schedule (:meth:`ResolvedLayout.microbatches_at`). Pipeline: each stage's chunks as
global layer ranges (:func:`chunk_layer_ranges`). Vocabulary padded to a multiple of
``make_vocab_size_divisible_by x tp``; the model FLOPs per token and each rank's GEMM
shapes of one micro-batch (:mod:`megalite.config.shapes`), once the vocabulary is known.

Pipeline chunks: with ``p`` stages and ``v`` virtual chunks per stage, the model is cut
into ``p * v`` consecutive pieces laid out round-robin, as in Megatron-LM's interleaved
schedule: piece ``c * p + r`` (chunk ``c`` of stage ``r``) holds the layers after pieces
``0 .. c*p + r - 1``. Stage ``r`` holds ``n_r`` layers (equal by default; the first and last
stage may differ with ``--decoder-first/last-pipeline-num-layers``), split equally over
its ``v`` chunks. ZB-V's V placement (``ResolvedLayout.v_shape``) puts piece ``r`` and piece
``2p - 1 - r`` on stage ``r`` instead, so stage 0 holds the first and the last layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megalite.config import shapes
from megalite.config.batch_schedule import BatchSchedule
from megalite.config.fields import ConfigError
from megalite.config.parallel import (
    check_pipeline_schedule,
    expert_data_parallel_size,
    is_v_schedule,
)


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
                       first: int | None = None, last: int | None = None,
                       v_shape: bool = False) -> list[list[tuple[int, int]]]:
    """Global layer ranges ``ranges[stage][chunk] = (first_layer, num_layers)``.

    ``first_layer`` is 0-based and global, so a layer's number (and so its initial weights
    and checkpoint name) does not depend on the layout. ``v_shape`` (ZB-V's placement, two
    chunks per stage, no uneven stages): ``2p`` equal pieces, stage ``r`` holding piece
    ``r`` as chunk 0 and piece ``2p - 1 - r`` as chunk 1.
    """
    v = vpp or 1
    if v_shape:
        if v != 2 or first is not None or last is not None or num_layers % (2 * pp):
            raise ConfigError(f"the V placement cuts {num_layers} layers into 2 x {pp} equal "
                              f"chunks (virtual size 2, no uneven first/last stage); got "
                              f"virtual size {v}, first={first}, last={last}")
        n = num_layers // (2 * pp)
        return [[(r * n, n), ((2 * pp - 1 - r) * n, n)] for r in range(pp)]
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


@dataclass(frozen=True)
class ResolvedLayout:
    """One run's resolved layout (module docstring); build with :meth:`MegaliteConfig.resolve`
    or :func:`resolve_layout`."""

    world_size: int
    tp: int
    cp: int
    pp: int
    vpp: int                  # virtual chunks per pipeline stage; 1 without interleaving
    dp: int
    ep: int
    etp: int
    edp: int
    sequence_parallel: bool
    micro_batch_size: int
    global_batch_size: int    # the final one of a batch-size schedule
    num_microbatches: int     # per step, of the final global batch
    batch_schedule: BatchSchedule
    stage_chunks: tuple[tuple[tuple[int, int], ...], ...]  # [pp rank][chunk] = (first, n)
    strategy: str             # --data-parallel-sharding-strategy
    dtype: torch.dtype
    seq_length: int
    padded_vocab_size: int | None = None        # None until the vocabulary is known
    flops_per_token: float | None = None        # whole model, forward + backward
    gemms: tuple[tuple[int, int, int, int], ...] | None = None
    # (tokens, in, out, count) of one micro-batch's linear layers on one rank of the
    # stage with the most layers: qkv, projection, the dense layers' fc1 and fc2 (MoE
    # experts not included), and the output layer
    pipeline_schedule: str | None = None  # --pipeline-schedule, resolved (None: by vpp)

    @property
    def v_shape(self) -> bool:
        """Two chunks per rank in a V (zbv): rank 0 holds the first and the last layers."""
        return is_v_schedule(self.pipeline_schedule)

    @property
    def interleaved(self) -> bool:
        return self.vpp > 1

    @property
    def sp(self) -> int:
        """The factor sequence parallelism splits the residual stream by (tp or 1)."""
        return self.tp if self.sequence_parallel else 1

    @property
    def dtype_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens one rank runs per micro-batch: ``micro_batch_size x seq_length / cp``."""
        return self.micro_batch_size * self.seq_length // self.cp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step of the final global batch: ``global_batch_size x
        seq_length``."""
        return self.global_batch_size * self.seq_length

    @property
    def model_flops_per_step(self) -> float:
        """Model FLOPs of one step of the final global batch (whole model)."""
        return self.flops_per_token * self.tokens_per_step

    def stage_layers(self, pp_rank: int) -> list[int]:
        """Global indices of the transformer layers of pipeline rank ``pp_rank`` (all its
        chunks)."""
        return [first + i for first, n in self.stage_chunks[pp_rank] for i in range(n)]

    def microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches of the step that starts after ``consumed_samples``."""
        return self.batch_schedule.num_microbatches(consumed_samples, self.micro_batch_size,
                                                    self.dp)

    def microbatch_steps(self) -> list[tuple[int, int]]:
        """``[(from consumed samples, micro-batches per step), ...]`` of the schedule."""
        return [(threshold, self.microbatches_at(threshold))
                for threshold, _ in self.batch_schedule.entries]

    def with_vocab(self, model_cfg) -> ResolvedLayout:
        """This layout with the vocabulary of ``model_cfg`` (its ``vocab_size`` set): the
        padded size, the FLOPs per token and the GEMM shapes."""
        vocab = model_cfg.padded_vocab_size(self.tp)
        tokens = self.tokens_per_microbatch
        stage = max((self.stage_layers(r) for r in range(self.pp)), key=len)
        dense = sum(not shapes.is_moe_layer(model_cfg, layer) for layer in stage)
        *attention, fc1, fc2 = shapes.layer_gemms(model_cfg, tokens, self.tp)
        return dataclasses.replace(
            self, padded_vocab_size=vocab,
            flops_per_token=shapes.flops_per_token(model_cfg, vocab),
            gemms=(*((*g, len(stage)) for g in attention), (*fc1, dense), (*fc2, dense),
                   (tokens, model_cfg.hidden_size, vocab // self.tp, 1)))

    def describe(self) -> str:
        """``tp 2 cp 1 pp 2 (vpp 2) dp 4 ep 2 etp 2 edp 2 | 8 micro-batches of 2``; a
        zero-bubble schedule is named after the pipeline size (``pp 4 (zb_h1)``)."""
        vpp = f" (vpp {self.vpp})" if self.interleaved else ""
        if self.pipeline_schedule in ("zb_h1", "zbv", "dualpipev"):
            vpp = f" ({self.pipeline_schedule})"
        return (f"tp {self.tp} cp {self.cp} pp {self.pp}{vpp} dp {self.dp} ep {self.ep} "
                f"etp {self.etp} edp {self.edp} | {self.num_microbatches} micro-batches of "
                f"{self.micro_batch_size}")


def resolve_layout(cfg, world_size: int) -> ResolvedLayout:
    """The :class:`ResolvedLayout` of ``cfg`` (a MegaliteConfig validated for ``world_size``:
    :meth:`MegaliteConfig.resolve` does both)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, \
        p.pipeline_model_parallel_size
    dp = p.data_parallel_size(world_size)
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    vpp = p.virtual_pipeline_model_parallel_size or 1
    chunks = chunk_layer_ranges(m.num_layers, pp, vpp, p.decoder_first_pipeline_num_layers,
                                p.decoder_last_pipeline_num_layers,
                                is_v_schedule(p.pipeline_schedule))
    schedule = BatchSchedule.from_config(t, m.seq_length)
    final = schedule.entries[-1][0]   # consumed samples from which the batch is final
    layout = ResolvedLayout(
        world_size=world_size, tp=tp, cp=cp, pp=pp, vpp=vpp, dp=dp, ep=ep, etp=etp,
        edp=expert_data_parallel_size(tp, cp, dp, ep, etp), sequence_parallel=p.sequence_parallel,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        num_microbatches=schedule.num_microbatches(final, t.micro_batch_size, dp),
        batch_schedule=schedule,
        stage_chunks=tuple(tuple(stage) for stage in chunks),
        strategy=p.data_parallel_sharding_strategy, dtype=m.params_dtype,
        seq_length=m.seq_length,
        pipeline_schedule=check_pipeline_schedule(p.pipeline_schedule, vpp))
    return layout.with_vocab(m) if m.vocab_size is not None else layout
