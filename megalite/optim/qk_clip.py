"""QK-clip (``--qk-clip``; Kimi-K2's MuonClip, with Megatron-Core's flags and rules) and the
step's largest attention logit (``--log-max-attention-logit``).

Each attention layer records, in its training forwards, the largest softmax-scaled logit
of each of its heads (:mod:`megalite.transformer.max_logits`). Once per step, after the
last backward:

1. :func:`step_max_logits`: every layer's ``[nh/tp]`` maxima of this rank, MAX over
   ``ps.dp_cp`` (one all-reduce of all layers at once): the maximum over the whole global
   batch -- its data-parallel and context-parallel shares and its micro-batches -- which
   is what one process sees (Megatron-Core reduces over the same group). Tensor
   parallelism splits heads, so each rank holds whole heads; pipeline stages hold whole
   layers.
2. :func:`clip_factors`: for a layer with a head above ``tau = --qk-clip-threshold``,
   ``eta = min(1, tau / max)`` per head and the layer's row factors
   (``SelfAttention.qk_clip_scales``, ``MLASelfAttention.qk_clip_scales``): queries
   ``eta ** alpha``, keys ``eta ** (1 - alpha)`` (``alpha = --qk-clip-alpha``).
3. the optimizer's step multiplies the updated fp32 masters by them before writing the
   model's parameters (``step(row_scales=...)``; the distributed optimizer on each rank's
   pieces of them, before the all-gather), so masters and model stay one and the same
   and every layout reproduces the one-process clip. As in Megatron-Core it runs with
   any ``--optimizer`` (Muon's companion, but AdamW too), and after the update: the
   factors come from the logits of the weights before it.
4. :func:`max_attention_logit`: the largest of them all, MAX over the world (the logged
   value).

Nothing is checkpointed: the maxima are reset before every step's first forward.
"""

from __future__ import annotations

import torch

from megalite.parallel.collectives import ReduceOp, all_reduce, all_reduce_scalar
from megalite.pipeline.layout import model_chunks


def attention_layers(model) -> list:
    """The attention modules of this rank's chunks that track their maxima, in order."""
    return [m for chunk in model_chunks(model) for m in chunk.modules()
            if getattr(m, "max_logits", None) is not None]


def reset_max_logits(model) -> None:
    """Forget the maxima (before a step's first forward)."""
    for m in attention_layers(model):
        m.max_logits.reset()


@torch.no_grad()
def step_max_logits(model, ps) -> list[torch.Tensor]:
    """Per attention layer of this rank, ``[nh/tp]`` fp32: its heads' largest logit over
    the step's forwards of the whole global batch (MAX over ``ps.dp_cp``, collective; a
    layer that saw no forward counts ``-inf``)."""
    layers = attention_layers(model)
    if not layers:
        return []
    values = [m.max_logits.value if m.max_logits.value is not None else
              torch.full((m.local_heads,), float("-inf"), device=ps.device) for m in layers]
    flat = all_reduce(torch.cat(values), ps.dp_cp, op=ReduceOp.MAX)
    return list(flat.split([v.numel() for v in values]))


def clip_factors(model, maxima: list[torch.Tensor], threshold: float,
                 alpha: float) -> dict:
    """``{parameter: factor}`` of the layers with a head above ``threshold`` (``maxima``
    from :func:`step_max_logits`, same order): what ``optimizer.step(row_scales=...)``
    multiplies the masters by."""
    factors = {}
    for m, top in zip(attention_layers(model), maxima):
        if bool((top > threshold).any()):
            eta = torch.where(top > threshold, threshold / top, torch.ones_like(top))
            factors.update(m.qk_clip_scales(eta, alpha))
    return factors


def max_attention_logit(maxima: list[torch.Tensor], ps) -> float:
    """The largest logit of every layer and head (MAX over the world, collective)."""
    local = max((float(t.max()) for t in maxima), default=float("-inf"))
    return all_reduce_scalar(local, None, ReduceOp.MAX, ps.device)
