"""Forward and backward of one global batch's micro-batches through the pipeline schedule.

Every layout goes through :func:`megalite.pipeline.schedules.run_schedule`: with one
pipeline stage the 1F1B steps are F0 B0 F1 B1 ... (plain gradient accumulation); with
``p`` stages 1F1B, and with virtual chunks the interleaved schedule. All pipeline stages
of a data-parallel rank read the same micro-batches: the first stage needs the tokens, the
last the labels and loss mask, and every stage the position ids (RoPE).

Loss normalization. Two modes, chosen by :func:`loss_divisors`:

- ``global-tokens`` (megalite's default, and what Megatron's ``--calculate-per-token-loss``
  computes): each micro-batch's summed masked loss is divided by the valid-token count of
  the whole global batch (``tokens``, SUM over micro-batches and ``ps.dp_cp``), and the
  data-parallel reduction sums, so the gradient is that of the global-batch token mean
  ``sum_i l_i m_i / sum_i m_i``, for any dp / micro-batch / pipeline split. Megatron gets
  the same by summing and dividing the gradients by the global token count at the end.
  megalite keeps it as the default because it is the only layout-invariant choice (the
  design's contract), so ``--calculate-per-token-loss`` selects what already runs.
- ``per-microbatch`` (``--per-microbatch-loss``: Megatron's default without the flag): each
  micro-batch's token mean ``sum l m / sum m`` over its own tokens, divided by
  ``num_microbatches x dp`` (Megatron divides by the number of micro-batches and averages
  gradients over dp). With uneven loss masks this weights tokens of sparse micro-batches
  more, and the result depends on the micro-batch split.

The reported ``lm_loss`` is the global token mean in both modes.

MoE router losses (aux, z) reach the gradient inside the MoE layers (not through the LM
loss). Their objective is the mean over the global batch's micro-batches, so before the
schedule every MoE layer of every chunk gets the gradient factor
``loss_scale / (num_microbatches * dp)`` (``dp`` without cp: cp ranks share one
micro-batch's loss, and the dp_cp gradient sum adds their parts). Their logged values
are collected per micro-batch by a :class:`RouterLosses`. The routers' expert-load
counts (``--moe-router-enable-expert-bias``) are zeroed before the schedule, so they hold
this step's micro-batches (a validation re-run starts them again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megalite.moe.expert_bias import reset_expert_load
from megalite.moe.layer import moe_layers, set_aux_loss_scale
from megalite.parallel.collectives import all_reduce
from megalite.pipeline.layout import model_chunks
from megalite.pipeline.p2p import PipeComm
from megalite.pipeline.schedules import ScheduleStats, layout_schedules, run_schedule


def activation_shape(cfg, ps) -> tuple[int, int, int]:
    """Shape of the tensor passed between stages: ``[s/cp, b, h]`` (``[s/(cp tp), b, h]``
    under SP): each context-parallel rank holds ``s/cp`` tokens of the sequence."""
    seq = cfg.model.seq_length // ps.cp.size
    if cfg.parallel.sequence_parallel and ps.tp.size > 1:
        seq //= ps.tp.size
    return (seq, cfg.train.micro_batch_size, cfg.model.hidden_size)


class RouterLosses:
    """The MoE layers' logged router losses (``moe_aux_loss``, ``moe_z_loss``) of one step.

    :meth:`add` after each forward of a model chunk on a micro-batch sums the values of
    the chunk's MoE layers (each already the loss of the whole micro-batch, see
    ``megalite.moe.router``); :meth:`means` turns the sums into means over every MoE
    layer, micro-batch and data-parallel rank of the global batch.
    """

    KEYS = ("moe_aux_loss", "moe_z_loss")

    def __init__(self, device: torch.device):
        # [sum per key..., count per key...]
        self.totals = torch.zeros(2 * len(self.KEYS), dtype=torch.float64, device=device)

    def add(self, chunk: torch.nn.Module) -> None:
        n = len(self.KEYS)
        for layer in moe_layers(chunk):
            for i, key in enumerate(self.KEYS):
                value = layer.aux_losses.get(key)
                if value is not None:
                    self.totals[i] += value.detach().double().reshape(())
                    self.totals[n + i] += 1.0

    def means(self) -> dict[str, float]:
        """Means over the global batch; collective over the whole world (every rank must
        call it). Each (layer, micro-batch, dp rank) is counted on its tp x cp ranks, the
        same number on every pipeline stage, so sums / counts is the plain mean. Keys
        with no value anywhere (coefficient 0) are left out."""
        totals = all_reduce(self.totals.clone(), None)
        n = len(self.KEYS)
        return {key: float(totals[i] / totals[n + i])
                for i, key in enumerate(self.KEYS) if totals[n + i] > 0}


class MTPLosses:
    """The multi-token prediction losses of one step (``mtp_1_loss`` .. ``mtp_N_loss``):
    :meth:`add` on the last stage after each micro-batch's forward sums each depth's masked
    loss and its rolled mask's tokens; :meth:`means` gives each depth's token mean over the
    global batch (as ``lm_loss``)."""

    def __init__(self, depths: int, device: torch.device):
        self.depths = depths
        self.totals = torch.zeros(2 * depths, dtype=torch.float64, device=device)

    def add(self, masked: list[torch.Tensor], masks: torch.Tensor) -> None:
        """``masked``: each depth's summed masked loss (scalars); ``masks`` ``[N, b, s]``."""
        n = self.depths
        self.totals[:n] += torch.stack([m.detach().double() for m in masked])
        self.totals[n:] += masks.double().sum(dim=(1, 2))

    def means(self) -> dict[str, float]:
        """Collective over the whole world (every rank must call it). The sums of the last
        stage's tp ranks repeat each other in both the loss and the token count; cp and
        dp ranks add their tokens."""
        totals = all_reduce(self.totals.clone(), None)
        n = self.depths
        return {f"mtp_{k + 1}_loss": float(totals[k] / totals[n + k].clamp_min(1.0))
                for k in range(n)}


def loss_divisors(batches: list[dict], tokens: torch.Tensor, per_microbatch: bool,
                  dp: int) -> list[torch.Tensor]:
    """What each micro-batch's summed masked loss is divided by (see module docstring):
    ``tokens`` (global count, fp64) for every micro-batch, or with ``per_microbatch`` its
    own token count (at least 1) x ``len(batches)`` x ``dp``."""
    if not per_microbatch:
        return [tokens] * len(batches)
    scale = float(len(batches) * dp)
    return [b["loss_mask"].double().sum().clamp_min(1.0).reshape(1) * scale
            for b in batches]


def mtp_loss_divisors(batches: list[dict], dp: int) -> list[torch.Tensor]:
    """Under ``--per-microbatch-loss``: what each micro-batch's summed masked loss of each
    prediction depth is divided by, fp64 ``[N]``: its rolled loss mask's tokens (at least
    1) x ``len(batches)`` x ``dp``, as Megatron-Core divides each depth's loss by the
    rolled mask's count (``num_tokens`` of its roll) and the schedule by the micro-batches."""
    scale = float(len(batches) * dp)
    return [b["mtp_loss_mask"].double().sum(dim=(1, 2)).clamp_min(1.0) * scale
            for b in batches]


def forward_backward(c, batches: list[dict], tokens, *, train: bool = True,
                     loss_scale: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                     stats: ScheduleStats | None = None,
                     router_losses: RouterLosses | None = None,
                     mtp_losses: MTPLosses | None = None,
                     mtp_divisors: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Run this rank's micro-batches ``batches`` (dicts of ``[b, s]`` tensors).

    tokens: fp64 scalar tensor, valid tokens of the whole global batch (every rank), or a
        list with one divisor per micro-batch (:func:`loss_divisors`).
    loss_scale: applied to each micro-batch's normalized loss before backward (fp16).
    router_losses: if given, collects the MoE router losses of every micro-batch.
    mtp_losses: if given, collects the multi-token prediction losses; the batches then
        carry the rolled entries (``transformer.mtp.roll_for_mtp``), and each micro-batch's
        loss gains ``mtp_loss_scaling_factor / N`` times the depths' summed masked losses,
        divided like the LM loss (Megatron-Core's ``MTPLossAutoScaler`` with
        ``--calculate-per-token-loss``), or with ``mtp_divisors`` (per micro-batch, one
        per depth: :func:`mtp_loss_divisors`) by those.
    Returns the fp64 SUM of the masked per-token loss over this rank's micro-batches,
    identical on every pipeline stage (broadcast from the last stage over ``ps.pp``).
    """
    ps = c.ps
    chunks = model_chunks(c.model)
    vpp = len(chunks)
    if train:  # see the module docstring; a no-op without MoE layers
        scale = float(loss_scale(torch.ones((), dtype=torch.float64)))
        for chunk in chunks:
            set_aux_loss_scale(chunk, scale / (len(batches) * ps.dp.size))
        reset_expert_load(chunks)  # the expert bias counts this step's forwards only
    loss_sum = torch.zeros(1, dtype=torch.float64, device=ps.device)
    divisors = tokens if isinstance(tokens, list) else [tokens] * len(batches)

    def forward_step(chunk: int, mb: int, hidden: torch.Tensor | None):
        batch = batches[mb]
        module = chunks[chunk]
        is_last = ps.is_pipeline_last_stage(chunk)
        docs = {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}
        mtp = {}
        if is_last and mtp_losses is not None:
            mtp = {"mtp_tokens": batch["mtp_tokens"], "mtp_labels": batch["mtp_labels"]}
        out = module(batch["tokens"] if hidden is None else None,
                     position_ids=batch.get("position_ids"),
                     labels=batch["labels"] if is_last else None,
                     hidden_states=hidden, **docs, **mtp)
        if router_losses is not None:
            router_losses.add(module)
        if not is_last:
            return out
        masked = (out.float() * batch["loss_mask"].float()).sum()
        loss_sum.add_(masked.detach().double())
        if mtp:
            per_depth = module.mtp_losses
            mask = batch["mtp_loss_mask"].float()
            mtp_masked = [(loss.float() * mask[k]).sum() for k, loss in enumerate(per_depth)]
            mtp_losses.add(mtp_masked, mask)
            weight = c.cfg.model.mtp_loss_scaling_factor / len(per_depth)
            if mtp_divisors is not None:
                depths = (torch.stack(mtp_masked) / mtp_divisors[mb].float()).sum()
                return loss_scale(masked / divisors[mb].float() + weight * depths)
            masked = masked + weight * torch.stack(mtp_masked).sum()
        return loss_scale(masked / divisors[mb].float())

    comm = None
    if ps.pp.size > 1:
        comm = PipeComm(ps, activation_shape(c.cfg, ps), _dtype(chunks[0]),
                        c.cfg.parallel.variable_seq_lengths)
    steps = layout_schedules(c.layout, len(batches), train)
    run_schedule(steps, forward_step=forward_step, ps=ps, vpp=vpp, comm=comm,
                 train=train, stats=stats, v_shape=c.layout.v_shape,
                 pair_backward_forward=c.cfg.parallel.overlap_moe_expert_parallel_comm,
                 delay_wgrad=c.cfg.parallel.delay_wgrad_compute)
    if ps.pp.size > 1:  # only the last piece's stage computed the loss (zbv: rank 0)
        all_reduce(loss_sum, ps.pp)
    return loss_sum


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
