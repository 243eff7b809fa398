"""One inference forward of a model that may be split into pipeline stages.

With ``ps.pp.size == 1`` :func:`stage_forward` is the model's own forward. With pipeline
parallelism each rank holds one stage (``loading.load_model`` builds it from
``config.layout.chunk_layer_ranges``; no virtual chunks) and its layers' part of the
KV cache; one call runs the whole batch through the stages in turn, with no
micro-batch pipelining (a decoding step is one token per row, so there is nothing to
overlap; stages wait for each other):

* stage 0 embeds the tokens and runs its layers; every other stage receives the hidden
  state ``[s, b, h]`` from the previous stage (point to point over ``ps.pp``; every
  rank knows ``s`` and ``b`` from the token ids it was given, so no shape is exchanged);
* every stage but the last sends its output ``[s, b, h]`` to the next one;
* the last stage applies the output layer (and the loss, given labels).

Each tp rank of a stage talks to the same tp rank of the next (the ``pp`` group holds
one rank per stage at this rank's tp position), and hidden states are replicated over
tp (no sequence parallelism at inference). Only the last stage has logits;
:func:`share_tokens` gives every rank of the world the tokens the last stage chose.
"""

from __future__ import annotations

import torch

from megalite.parallel import collectives


def is_last_stage(model) -> bool:
    return model.ps.pp.rank == model.ps.pp.size - 1


def _neighbour(ps, step: int) -> int:
    return ps.pp.ranks[ps.pp.rank + step]


def _recv(model, shape) -> torch.Tensor:
    """``[s, b, h]`` from the previous stage (over ``ps.pp``)."""
    dtype = next(model.parameters()).dtype
    buf = torch.empty(shape, dtype=dtype, device=model.ps.device)
    collectives.wait_all(collectives.batch_isend_irecv(
        [], [(buf, _neighbour(model.ps, -1))], model.ps.pp))
    return buf


def _send(model, x: torch.Tensor) -> None:
    """``[s, b, h]`` to the next stage (over ``ps.pp``)."""
    collectives.wait_all(collectives.batch_isend_irecv(
        [(x.contiguous(), _neighbour(model.ps, 1))], [], model.ps.pp))


def stage_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                  inference_cache=None, labels: torch.Tensor | None = None,
                  document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The model's output for int64 ``input_ids`` ``[b, s]`` (given on every stage):
    this rank's logits ``[b, s, V_padded/tp]``, or with ``labels`` the per-token loss fp32
    ``[b, s]`` (see ``GPTModel.forward``), on the last pipeline stage; None on the
    others. ``inference_cache``: this stage's layers read and extend it, and its
    ``seq_len`` advances by ``s`` on every stage."""
    ps = model.ps
    if ps.pp.size == 1:
        return model(input_ids, position_ids=position_ids, labels=labels,
                     document_ids=document_ids, inference_cache=inference_cache)
    b, s = input_ids.shape
    hidden = None
    if not model.pre_process:
        hidden = _recv(model, (s, b, model.config.hidden_size))
    last = model.post_process
    out = model(input_ids if model.pre_process else None, position_ids=position_ids,
                labels=labels if last else None, hidden_states=hidden,
                document_ids=document_ids, inference_cache=inference_cache)
    if not last:
        _send(model, out)
        return None
    return out


def share_tokens(model, tokens: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[b]``: the tokens tp rank 0 of the last pipeline stage chose, on every
    rank. A broadcast over ``ps.tp`` on the last stage (so sampling cannot drift apart
    between tp ranks), then over ``ps.pp`` from the last stage (``tokens`` is None on the
    other stages)."""
    ps = model.ps
    if is_last_stage(model) and ps.tp.size > 1:
        tokens = torch.tensor(collectives.broadcast_object_list(
            [tokens.tolist()], src=ps.tp.ranks[0], group=ps.tp)[0], dtype=torch.int64)
    if ps.pp.size > 1:
        tokens = torch.tensor(collectives.broadcast_object_list(
            [None if tokens is None else tokens.tolist()], src=ps.pp.ranks[-1],
            group=ps.pp)[0], dtype=torch.int64)
    return tokens.to(ps.device)


def from_last_stage(model, obj):
    """The last pipeline stage's ``obj`` (any picklable value) on every stage (a
    broadcast over ``ps.pp``; ``obj`` itself at pp = 1)."""
    ps = model.ps
    if ps.pp.size == 1:
        return obj
    return collectives.broadcast_object_list([obj], src=ps.pp.ranks[-1], group=ps.pp)[0]
