"""Generate text from a megalite checkpoint (any saved layout): one process, tp, pp or both.

    python tools/generate.py --load runs/pretrain_tiny_cpu/checkpoints \
        --prompt "In the beginning" --max-new-tokens 40 --temperature 0.8 --top-p 0.9
    torchrun --nproc-per-node 2 tools/generate.py --load runs/pretrain_tiny_cpu/checkpoints \
        --tensor-model-parallel-size 2 --prompts-file prompts.txt --temperature 0
    torchrun --nproc-per-node 4 tools/generate.py --load runs/pretrain_tiny_cpu/checkpoints \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --prompt "And God"

Greedy with ``--temperature 0`` (the default is 1.0); ``--top-k``/``--top-p`` filter;
``--seed`` makes sampling repeatable; generation stops at the end-of-document token or
the model's sequence length. Prompts: ``--prompt`` (repeatable), ``--prompts-file`` (one
per line), or ``--interactive`` (read prompts from stdin); up to ``--batch-size`` of them
are decoded together (left-padded; greedy output is the same as one at a time). The
tokenizer is the one the checkpoint records unless the tokenizer flags say otherwise. A
KV cache makes each new token one token's forward. ``--tensor-model-parallel-size T``
splits the model's heads and vocabulary over T ranks, ``--pipeline-model-parallel-size
P`` its layers over P stages (each step's hidden state goes from stage to stage, no
micro-batch pipelining), under ``torchrun --nproc-per-node T*P``; an MoE model's experts
are split over ``--expert-model-parallel-size`` E ranks x ``--expert-tensor-parallel-size``
(default E 1 and T; E x etp divides T). The checkpoint is resharded on load; rank 0
prints. Context and sequence parallelism are refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

import torch  # noqa: E402

from megalite.config.run import DEFAULT_SEED  # noqa: E402
from megalite.errors import report_tool_error  # noqa: E402

PROG = "generate"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: latest)")
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="ranks the model is split over (launch that many with torchrun)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages the layers are split over (tp x pp ranks)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="MoE: ranks the experts are spread over (ep x etp must divide tp)")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="MoE: tensor parallel size of the experts (default: tp)")
    p.add_argument("--context-parallel-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)


def load(args):
    """(cfg, model, tokenizer, ParallelState) for the load flags (collective over the
    ranks torchrun started)."""
    from megalite.inference.loading import load_for_inference, state_for_args

    ps = state_for_args(args)
    cfg, model, tokenizer = load_for_inference(args.load, args.ckpt_step, args, ps)
    return cfg, model, tokenizer, ps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument("--interactive", action="store_true", help="read prompts from stdin")
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    add_sampling_args(p)
    return p.parse_args(argv)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise FileNotFoundError(f"cannot read --prompts-file: {exc}") from None
    return prompts


def continuations(model, tokenizer, texts: list[str], args, generator) -> list[str]:
    """The decoded continuation of each of ``texts``, ``--batch-size`` at a time."""
    from megalite.inference.generation import generate_batch
    from megalite.inference.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    out = []
    for i in range(0, len(texts), args.batch_size):
        prompts = [tokenizer.tokenize(t) for t in texts[i:i + args.batch_size]]
        for prompt, ids in zip(prompts, generate_batch(
                model, prompts, args.max_new_tokens, params, eod=tokenizer.eod,
                generator=generator)):
            out.append(_new_text(tokenizer, prompt, ids[:-1] if ids[-1:] == [tokenizer.eod]
                                 else ids))
    return out


def _new_text(tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text ``new`` adds after ``prompt``: decoded together, so a word boundary between
    them keeps its space (SentencePiece drops a leading one when decoding ``new`` alone)."""
    head, whole = tokenizer.detokenize(prompt), tokenizer.detokenize(prompt + new)
    return whole[len(head):] if whole.startswith(head) else tokenizer.detokenize(new)


def _interactive(model, tokenizer, args, generator, ps) -> None:
    """Rank 0 reads a prompt from stdin and broadcasts it to every rank; an empty line or
    end of input (None to the others) ends."""
    from megalite.parallel.collectives import broadcast_object_list

    while True:
        text = None
        if ps.rank == 0:
            print("prompt (empty line or Ctrl-D to quit)> ", end="", flush=True)
            line = sys.stdin.readline()
            text = line.rstrip("\n") or None
        text = broadcast_object_list([text], src=0)[0]
        if text is None:
            return
        out = continuations(model, tokenizer, [text], args, generator)[0]
        if ps.rank == 0:
            print(text + out, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megalite.inference.sampling import SamplingParams

        SamplingParams(args.temperature, args.top_k, args.top_p).check()
        if args.batch_size < 1 or args.num_samples < 1:
            raise ValueError(f"--batch-size ({args.batch_size}) and --num-samples "
                             f"({args.num_samples}) must be >= 1")
        prompts = read_prompts(args)
        if not prompts and not args.interactive:
            raise ValueError("give --prompt, --prompts-file or --interactive")
        _cfg, model, tokenizer, ps = load(args)
        generator = torch.Generator().manual_seed(args.seed)
        texts = [t for t in prompts for _ in range(args.num_samples)]
        for text, out in zip(texts, continuations(model, tokenizer, texts, args, generator)):
            if ps.rank == 0:
                print(f"[{text}]{out}", flush=True)
        if args.interactive:
            _interactive(model, tokenizer, args, generator, ps)
    except (KeyboardInterrupt, BrokenPipeError):
        return 130
    except Exception as exc:
        code = report_tool_error(PROG, exc, (ValueError, OSError, NotImplementedError))
        if code is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
