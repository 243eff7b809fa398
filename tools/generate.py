"""Generate text from a megalite checkpoint (any saved layout), in one process on CPU.

    python tools/generate.py --load runs/pretrain_tiny_cpu/checkpoints \
        --prompt "In the beginning" --max-new-tokens 40 --temperature 0.8 --top-p 0.9

Greedy with ``--temperature 0`` (the default is 1.0); ``--top-k``/``--top-p`` filter;
``--seed`` makes sampling repeatable; generation stops at the end-of-document token or
the model's sequence length. Prompts: ``--prompt`` (repeatable), ``--prompts-file`` (one
per line), or ``--interactive`` (read prompts from stdin). The tokenizer is the one the
checkpoint records unless the tokenizer flags say otherwise. A KV cache makes each new
token one token's forward. Tensor parallelism across ranks is not supported yet: the
checkpoint is loaded whole into this process.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.errors import report_tool_error  # noqa: E402

PROG = "generate"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=1234)


def add_load_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: latest)")
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument("--interactive", action="store_true", help="read prompts from stdin")
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
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


def continuation(model, tokenizer, text: str, args, generator) -> str:
    from megalite.inference.generation import generate
    from megalite.inference.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    ids = generate(model, tokenizer.tokenize(text), args.max_new_tokens, params,
                   eod=tokenizer.eod, generator=generator)
    if ids and ids[-1] == tokenizer.eod:
        ids = ids[:-1]
    return tokenizer.detokenize(ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megalite.inference.loading import load_for_inference
        from megalite.inference.sampling import SamplingParams

        SamplingParams(args.temperature, args.top_k, args.top_p).check()
        prompts = read_prompts(args)
        if not prompts and not args.interactive:
            raise ValueError("give --prompt, --prompts-file or --interactive")
        _cfg, model, tokenizer = load_for_inference(args.load, args.ckpt_step, args)
        generator = torch.Generator().manual_seed(args.seed)
        for text in prompts:
            for _ in range(args.num_samples):
                print(f"[{text}]{continuation(model, tokenizer, text, args, generator)}",
                      flush=True)
        if args.interactive:
            print("prompt (empty line or Ctrl-D to quit)> ", end="", flush=True)
            for line in sys.stdin:
                text = line.rstrip("\n")
                if not text:
                    break
                print(text + continuation(model, tokenizer, text, args, generator), flush=True)
                print("prompt> ", end="", flush=True)
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
