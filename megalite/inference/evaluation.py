"""Validation loss of a model on a dataset's validation split, as the training loop's
evaluation computes it (``megalite.training.loop.evaluate``): the token mean of the
per-token loss over ``eval_iters`` global batches, read from the validation split where
the loop read them at a given iteration."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megalite.inference.stages import from_last_stage, stage_forward
from megalite.parallel.cp_chunks import with_document_ids


def eval_start_sample(train_cfg, iteration: int) -> int:
    """The first validation sample the training loop's evaluation at ``iteration`` read
    (every ``eval_interval`` iterations it reads ``eval_iters`` global batches from one
    stream that starts at sample 0)."""
    runs_before = max(iteration // train_cfg.eval_interval - 1, 0) \
        if iteration % train_cfg.eval_interval == 0 else iteration // train_cfg.eval_interval
    return runs_before * train_cfg.eval_iters * train_cfg.global_batch_size


def validation_samples(dataset, start: int, count: int, micro_batch_size: int):
    """Micro-batches (dicts of ``[mbs, s]`` tensors) of ``count`` samples of ``dataset``
    from ``start``, wrapping around at its end as the training loop's iterator does."""
    from megalite.data.samplers import build_data_loader

    total = len(dataset)
    if total < micro_batch_size:
        raise ValueError(f"the validation set holds {total} samples, fewer than one "
                         f"micro-batch of {micro_batch_size}")
    left, start = count, start % total
    while left > 0:
        for batch in build_data_loader(dataset, start, micro_batch_size, 0, 1):
            yield batch
            left -= batch["tokens"].shape[0]
            if left <= 0:
                return
        start = 0


@torch.no_grad()
def validation_loss(model, batches, num_batches: int,
                    progress: Callable[[int, int], None] | None = None) -> tuple[float, int]:
    """(mean per-token loss, tokens counted) of ``model`` over ``batches``. Under
    pipeline parallelism every stage runs every batch (:func:`stages.stage_forward`, one
    micro-batch at a time) and the last stage's sums are broadcast over ``ps.pp``."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    for i, batch in enumerate(batches):
        batch = with_document_ids(batch)
        out = stage_forward(model, batch["tokens"], batch.get("position_ids"),
                            labels=batch["labels"], document_ids=batch.get("document_ids"))
        mask = batch["loss_mask"].float()
        if out is not None:
            loss_sum += (out.float() * mask).sum().double()
        tokens += mask.double().sum()
        if progress is not None:
            progress(i + 1, num_batches)
    loss_sum = from_last_stage(model, loss_sum)
    return float(loss_sum / tokens.clamp_min(1.0)), int(tokens.item())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))


def jsonl_batches(path: str, tokenizer, seq_length: int, micro_batch_size: int,
                  json_keys=("text",), max_samples: int | None = None) -> list[dict]:
    """Micro-batches of a JSONL (or plain text) file: its documents tokenized, each
    followed by the end-of-document token, concatenated and cut into non-overlapping
    samples of ``seq_length`` tokens (``tokens``/``labels``/``loss_mask`` ``[mbs, s]``;
    the last micro-batch may be smaller; a partial final sample is dropped)."""
    from megalite.data.jsonl import iter_texts

    stream: list[int] = []
    need = None if max_samples is None else max_samples * seq_length + 1
    for text in iter_texts(path, json_keys):
        stream += tokenizer.tokenize(text) + [tokenizer.eod]
        if need is not None and len(stream) >= need:
            break
    count = (len(stream) - 1) // seq_length
    if max_samples is not None:
        count = min(count, max_samples)
    if count == 0:
        raise ValueError(f"{path}: {len(stream)} tokens make no sample of {seq_length + 1} "
                         f"tokens (documents under keys {', '.join(json_keys)})")
    data = torch.tensor(stream[:count * seq_length + 1], dtype=torch.int64)
    tokens = data[:-1].view(count, seq_length)
    labels = data[1:].view(count, seq_length)
    return [{"tokens": tokens[i:i + micro_batch_size], "labels": labels[i:i + micro_batch_size],
             "loss_mask": torch.ones_like(tokens[i:i + micro_batch_size], dtype=torch.float32)}
            for i in range(0, count, micro_batch_size)]
