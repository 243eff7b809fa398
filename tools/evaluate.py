"""Validation loss and perplexity of a megalite checkpoint (any layout), one process or tp.

    python tools/evaluate.py --load runs/pretrain_tiny_cpu/checkpoints
    torchrun --nproc-per-node 2 tools/evaluate.py --load runs/pretrain_tiny_cpu/checkpoints \
        --tensor-model-parallel-size 2

Reads the checkpoint's recorded data settings (``--data-path``, ``--split``, sequence
length, batch sizes, seed), builds the same validation split as training did, and
evaluates ``--eval-iters`` global batches starting where the training loop's evaluation
at the checkpoint's iteration started: the printed loss is the loop's validation loss at
that iteration (up to fp32 rounding across layouts). ``--data-path`` / ``--split`` /
``--eval-iters`` override the recorded values. ``--jsonl FILE`` evaluates a JSONL (or
plain text) file instead: its documents tokenized, joined by end-of-document tokens and
cut into samples of the model's sequence length (``--max-samples`` caps them). Rank 0
counts micro-batches on stderr past 2 s (a bar on a terminal, a line every 10% or 30 s in
a log; ``--no-progress`` hides it) and prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.errors import report_tool_error  # noqa: E402

PROG = "evaluate"


def parse_args(argv=None) -> argparse.Namespace:
    from tools.generate import add_load_args

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--data-path", nargs="+", default=None, help="dataset prefix(es)")
    p.add_argument("--split", default=None)
    p.add_argument("--eval-iters", type=int, default=None, help="global batches")
    p.add_argument("--jsonl", default=None, help="a JSONL or text file to evaluate instead")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--max-samples", type=int, default=None, help="with --jsonl")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megalite.inference.evaluation import (
            eval_start_sample,
            jsonl_batches,
            perplexity,
            validation_loss,
            validation_samples,
        )
        from megalite.training.build import default_datasets_provider
        from tools.generate import load

        # the iteration first, then that one loaded: a live job may publish newer ones
        iteration = args.ckpt_step = _checkpoint_iteration(args)
        cfg, model, tokenizer, ps = load(args)
        t = cfg.train
        if args.data_path is not None:
            cfg.data.data_path = args.data_path
        if args.split is not None:
            cfg.data.split = args.split
        if args.eval_iters is not None:
            if args.eval_iters <= 0:
                raise ValueError(f"--eval-iters must be positive, got {args.eval_iters}")
            t.eval_iters = args.eval_iters
        if args.jsonl is not None:
            if not os.path.isfile(args.jsonl):
                raise FileNotFoundError(f"--jsonl {args.jsonl}: no such file")
            batches = jsonl_batches(args.jsonl, tokenizer, cfg.model.seq_length,
                                    t.micro_batch_size, args.json_keys, args.max_samples)
            num_batches = len(batches)
        else:
            _, valid, _ = default_datasets_provider(cfg, tokenizer)
            if valid is None:
                raise ValueError("the data settings leave no validation split (see --split)")
            count = t.eval_iters * t.global_batch_size
            num_batches = -(-count // t.micro_batch_size)
            batches = validation_samples(valid, eval_start_sample(t, iteration), count,
                                         t.micro_batch_size)
        from megalite.progress import Progress

        with Progress(num_batches, "evaluate", "micro-batch",
                      disable=bool(args.no_progress or ps.rank)) as bar:
            loss, tokens = validation_loss(model, batches, num_batches,
                                           lambda done, total: bar.update(1))
        if ps.rank == 0:
            print(f"validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                  f"lm loss PPL: {perplexity(loss):.6E} | tokens: {tokens}", flush=True)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        code = report_tool_error(PROG, exc)
        if code is None:
            raise
        return code
    return 0


def _checkpoint_iteration(args) -> int:
    from megalite.checkpoint.consolidated import checkpoint_config

    return checkpoint_config(args.load, args.ckpt_step)[1]


if __name__ == "__main__":
    sys.exit(main())
