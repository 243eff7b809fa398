#!/usr/bin/env python
"""Rank the parallel layouts of a model on a cluster by estimated step time.

    python tools/plan_layout.py --preset h100 --nodes 16 -- \\
        --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \\
        --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \\
        --position-embedding-type rope --untie-embeddings-and-output-weights \\
        --disable-bias-linear --vocab-size 128256 --seq-length 8192 --global-batch-size 512 --bf16

The model and batch come after ``--`` as megalite / Megatron flags (``--config run.yaml``
works there too), or from a launch script (``--megatron-script train.sh``: every ``--flag``
in it; layout flags are ignored, unknown ones skipped with a note). The cluster is a preset
(``--preset h100|h800|h200|a100`` x ``--nodes``) or given in full (``--gpus-per-node``,
``--gpu-memory-gib``, ``--peak-tflops``, ``--peak-fp8-tflops``, ``--peak-fp32-tflops``,
``--fp8-block-kernel`` / ``--no-fp8-block-kernel``, ``--intra-node-gbps``,
``--inter-node-gbps``, GB/s per GPU one way).
``--tp/--pp/--vpp/--cp/--ep N ...``, ``--strategies``, ``--recompute``,
``--micro-batch-sizes``, ``--offload-fractions`` and
``--pipeline-schedules`` (1f1b, zb_h1: tried with one model chunk per pipeline rank; zbv,
dualpipev: with two, in a V) narrow the search (e.g. to one published layout:
``examples/planner/``).
Prints the best ``--top`` feasible layouts with memory per rank by term, compute,
communication time and bytes per parallelism, bubble and MFU; then the best layout's flags
ready to paste; ``--show-infeasible N`` lists rejected layouts and the limit each breaks.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.arguments import build_parser, parse_args  # noqa: E402
from megalite.config import shapes  # noqa: E402
from megalite.config.fields import ConfigError  # noqa: E402
from megalite.errors import EXIT_CONFIG, report_tool_error  # noqa: E402
from megalite.planner import fp8_time  # noqa: E402
from megalite.planner.cluster import FRACTIONS, GIB, PRESETS, Cluster, preset  # noqa: E402
from megalite.planner.search import (  # noqa: E402
    RECOMPUTE,
    SCHEDULES,
    STRATEGIES,
    make_config,
    search,
)
from megalite.planner.time import OVERLAP_EXPOSED  # noqa: E402

PROG = "plan_layout.py"

LAYOUT_FLAGS = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--virtual-pipeline-model-parallel-size",
                "--num-layers-per-virtual-pipeline-stage", "--context-parallel-size",
                "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                "--micro-batch-size", "--recompute-granularity", "--recompute-method",
                "--recompute-num-layers", "--data-parallel-sharding-strategy",
                "--optimizer-offload-fraction", "--pipeline-schedule"}
# (the overlap flags are searched with the sharding strategy: --overlap-param-gather needs
# the distributed optimizer, which the search chooses)
LAYOUT_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--optimizer-cpu-offload",
                   "--overlap-grad-reduce", "--overlap-param-gather"}


_SHELL = {")", "(", "[[", "]]", "[", "]", ";", "then", "else", "fi", "do", "done", "&&", "||",
          "|", "{", "}"}
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_VAR = re.compile(r"\$\{(\w+)(?::?-((?:[^{}]|\{[^{}]*\})*))?\}|\$(\w+)")


def _expand(text: str, env: dict[str, str]) -> str:
    """``text`` with ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced from ``env``
    (unknown names, positional ``$1`` included, take their default or stay as text)."""
    def sub(m):
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return _expand(m.group(2), env)
        return m.group(0)
    return _VAR.sub(sub, text)


def _is_value(token: str) -> bool:
    """Whether ``token`` can be a flag's value rather than shell syntax or another
    flag or command (``-m``, ``X=(``, ``${ARGS[@]}``); negative numbers are values."""
    if token in _SHELL or token.endswith("=(") or "[@]" in token or "[*]" in token:
        return False
    if token.startswith("-"):
        return re.fullmatch(r"-[0-9.][0-9.e+-]*", token) is not None
    return True


def script_flags(text: str) -> tuple[list[str], list[str]]:
    """(flags megalite accepts, flags skipped) from a launch script's text: every
    ``--flag`` with as many values as megalite's parser takes for it (bash arrays,
    ``"--flag value"`` strings and line continuations as Megatron-LM's scripts write
    them), ``$VARIABLES`` replaced from the script's assignments above them. Both
    branches of an ``if`` are read."""
    tokens = []
    for tok in shlex.split(text.replace("\\\n", " "), comments=True):
        tokens += tok.split() if tok.startswith("--") and " " in tok else [tok]
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    env: dict[str, str] = {}
    out, skipped, i = [], [], 0
    while i < len(tokens):
        tok = tokens[i]
        assign = _ASSIGN.match(tok)
        if assign and not assign.group(2).startswith("("):
            env[assign.group(1)] = _expand(assign.group(2), env)
        if not tok.startswith("--"):
            i += 1
            continue
        action = actions.get(tok)
        nargs = None if action is None else action.nargs
        most = {0: 0, None: 1, "?": 1}.get(nargs, nargs if isinstance(nargs, int) else None)
        values, j = [], i + 1
        while j < len(tokens) and (most is None or len(values) < most) and (
                _is_value(tokens[j]) or (nargs is None and action is not None)):
            values.append(_expand(tokens[j], env))
            j += 1
        if action is not None:
            out += [tok, *values]
        else:
            skipped.append(tok)
        i = j
    return out, skipped


# what a run reads and writes, not what it computes: the planner builds the model alone
# (NullTokenizer, mock data), so a script's paths need not exist here
IO_FLAGS = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
            "--data-cache-path", "--mock-data", "--split", "--vocab-file", "--merge-file",
            "--tokenizer-type", "--tokenizer-model", "--tiktoken-pattern", "--save", "--load",
            "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--wandb-save-dir",
            "--metrics-jsonl", "--config-logger-dir", "--save-interval", "--no-load-optim",
            "--no-load-rng", "--ckpt-step", "--async-save", "--finetune"}
KNOWN_VOCAB = {"GPT2BPETokenizer": 50257}


def drop_flags(flags: list[str], names: set[str]) -> list[str]:
    """``flags`` without ``names`` and the values after each (up to the next ``--flag``)."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 1
            while i < len(flags) and not flags[i].startswith("--"):
                i += 1
            continue
        out.append(flags[i])
        i += 1
    return out


def strip_layout(flags: list[str]) -> list[str]:
    """``flags`` without the layout flags the planner chooses itself."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in LAYOUT_FLAGS:
            i += 2
            continue
        if flags[i] not in LAYOUT_SWITCHES:
            out.append(flags[i])
        i += 1
    return out


def _fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f}"


def model_line(model) -> str:
    """The searched model's size: parameters in all, per token, and training FLOPs per
    token (tp 1 vocabulary padding)."""
    vocab = model.padded_vocab_size(1)
    total, active = shapes.model_params(model, vocab)
    moe = f", {active / 1e9:.1f}B active per token" if model.num_experts else ""
    return (f"model: {total / 1e9:.1f}B parameters{moe}; "
            f"{shapes.flops_per_token(model, vocab) / 1e9:.1f} GFLOP per token "
            f"(forward and backward, seq {model.seq_length})")


def report(candidates, cluster: Cluster, top: int, show_infeasible: int,
           model=None) -> str:
    feasible = [c for c in candidates if c.feasible]
    lines = [*([model_line(model)] if model is not None else []),
             f"cluster: {cluster.nodes} x {cluster.gpus_per_node} {cluster.name} "
             f"({cluster.gpu_memory / GIB:.0f} GiB, {cluster.peak_flops / 1e12:.0f} TFLOP/s "
             f"peak, {cluster.intra_node_bw / 1e9:.0f} / {cluster.inter_node_bw / 1e9:.0f} "
             f"GB/s intra / inter node); {len(candidates)} layouts, {len(feasible)} feasible",
             f"assumed: GEMMs at {cluster.matmul_efficiency:.0%} of the peak, memory-bound "
             f"work at {cluster.memory_efficiency:.0%} of the memory bandwidth; an overlapped "
             f"data-parallel collective {OVERLAP_EXPOSED:.0%} exposed; searched with the "
             "layout: tp/pp/vpp/cp/ep, sharding strategy, --overlap-grad-reduce and "
             "--overlap-param-gather, recomputation, micro-batch size, optimizer offload "
             "(the model's own values of these are set aside)",
             *_fp8_lines(model, cluster),
             "",
             f"{'#':>3} {'layout':<60} {'step s':>8} {'MFU':>6} {'mem GiB':>8} "
             f"{'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'trans':>6} {'comm':>5} "
             f"{'compute':>8} {'tp s':>6} {'cp s':>6} {'ep s':>6} {'pp s':>6} {'dp s':>6} "
             f"{'bubble':>7}"]
    for i, c in enumerate(feasible[:top], 1):
        mem, t = c.memory, c.time
        lines.append(
            f"{i:>3} {c.name():<60} {t.step:>8.3f} {t.mfu:>6.1%} {_fmt_bytes(mem.total):>8} "
            f"{_fmt_bytes(mem.params):>7} {_fmt_bytes(mem.grads):>6} "
            f"{_fmt_bytes(mem.optimizer):>6} {_fmt_bytes(mem.activations):>6} "
            f"{_fmt_bytes(mem.transient):>6} "
            f"{_fmt_bytes(mem.comm_buffers + mem.gathered_params):>5} {t.compute:>8.3f} "
            + " ".join(f"{t.comm[k]:>6.3f}" for k in ("tp", "cp", "ep", "pp", "dp"))
            + f" {t.bubble:>7.3f}")
    if feasible:
        best = feasible[0]
        gb = {k: v / 1e9 for k, v in best.time.comm_bytes.items() if v}
        lines += ["", "best layout: " + best.name(),
                  "  bytes sent per rank per step (GB): "
                  + (", ".join(f"{k} {v:.2f}" for k, v in gb.items()) or "none"),
                  f"  in-flight micro-batch chunks on the busiest stage: "
                  f"{best.memory.in_flight}",
                  "  launch flags: " + " ".join(best.launch_flags())]
    else:
        first = next((c for c in candidates if c.error), None)
        lines += ["", "no feasible layout" + (f"; the first refused, {first.name().strip()}: "
                                              f"{first.error}" if first else "")]
    bad = [c for c in candidates if not c.feasible][:show_infeasible]
    if bad:
        lines += ["", f"infeasible (first {len(bad)}):"]
        lines += [f"  {c.name():<60} {c.error}" for c in bad]
    return "\n".join(lines)


def _fp8_lines(model, cluster: Cluster) -> list[str]:
    """Under ``--fp8-format``: the rate the fp8 GEMMs are timed at and, where megalite has
    no fp8 kernel for some of them on this cluster, a note naming them (they are timed as
    the fp32 products of the dequantised operands megalite runs instead) and the recipe
    that avoids it."""
    if model is None or model.fp8_format is None:
        return []
    out = [f"fp8 ({model.fp8_recipe}, {model.fp8_format}): GEMMs at "
           f"{cluster.fp8_flops / 1e12:.0f} TFLOP/s, the quantisation passes at memory "
           "bandwidth"]
    emulated = [g for g in fp8_time.GEMMS if g in fp8_time.emulated_gemms(model, cluster)]
    if emulated:
        fp32 = (cluster.fp32_flops or cluster.peak_flops) / 1e12
        if model.fp8_recipe == "blockwise" and cluster.fp8_block_kernel:
            better = "--fp8-format e4m3 (every blockwise GEMM on the block-scaled kernel)"
        elif cluster.fp8_block_kernel:
            better = ("--fp8-recipe blockwise --fp8-format e4m3 (block scales, on the "
                      "block-scaled kernel), tensorwise or delayed")
        else:
            better = "--fp8-recipe tensorwise or delayed"
        out.append(f"note: megalite has no fp8 kernel for --fp8-recipe {model.fp8_recipe}'s "
                   f"{', '.join(emulated)} GEMMs on the {cluster.name}: they are emulated "
                   f"(the dequantised operands multiplied in fp32, {fp32:.0f} TFLOP/s), as "
                   f"timed here; {better} runs them in fp8")
    return out


# the cluster flags: (Cluster field, scale to the field's unit, what the value must be)
CLUSTER_FLAGS = {"gpus_per_node": ("gpus_per_node", 1, "an integer >= 1"),
                 "gpu_memory_gib": ("gpu_memory", GIB, "a positive number"),
                 "peak_tflops": ("peak_flops", 1e12, "a positive number"),
                 "peak_fp8_tflops": ("fp8_flops", 1e12, "a positive number"),
                 "peak_fp32_tflops": ("fp32_flops", 1e12, "a positive number"),
                 "intra_node_gbps": ("intra_node_bw", 1e9, "a positive number"),
                 "inter_node_gbps": ("inter_node_bw", 1e9, "a positive number"),
                 "matmul_efficiency": ("matmul_efficiency", 1, "in (0, 1]"),
                 "memory_efficiency": ("memory_efficiency", 1, "in (0, 1]")}
# the cluster's yes/no flags (--flag / --no-flag; unset: the preset's): flag -> Cluster field
CLUSTER_SWITCHES = {"fp8_block_kernel": "fp8_block_kernel"}


def check_args(args) -> None:
    """Refuse this tool's numbers that cannot describe a cluster or a search (sizes below
    one, NaN, negative or zero rates, an efficiency above one), naming the flag and value."""
    def bad(flag: str, value, must: str):
        raise ConfigError(f"--{flag.replace('_', '-')} must be {must}, got {value}")

    if args.nodes < 1:
        bad("nodes", args.nodes, "an integer >= 1")
    for flag, (field, _, must) in CLUSTER_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if not value > 0 or (field in FRACTIONS and value > 1) or value == math.inf:
            bad(flag, value, must)
        if flag == "gpus_per_node" and value < 1:
            bad(flag, value, must)
    for flag in ("top", "show_infeasible"):
        if getattr(args, flag) < 0:
            bad(flag, getattr(args, flag), "an integer >= 0")
    for flag in ("micro_batch_sizes", "tp", "pp", "vpp", "cp", "ep"):
        for value in getattr(args, flag) or ():
            if value < 1:
                bad(flag, value, "a list of integers >= 1")
    for value in args.offload_fractions:
        if not 0 <= value <= 1:
            bad("offload_fractions", value, "a list of numbers in [0, 1]")


def build_cluster(args) -> Cluster:
    if args.preset:
        base = preset(args.preset, args.nodes)
    else:
        base = Cluster(8, args.nodes, 80 * GIB, 989e12, 450e9, 50e9)
    over = {field: getattr(args, flag) * scale
            for flag, (field, scale, _) in CLUSTER_FLAGS.items()
            if getattr(args, flag) is not None}
    over.update({field: getattr(args, flag) for flag, field in CLUSTER_SWITCHES.items()
                 if getattr(args, flag) is not None})
    return replace(base, **over)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plan_layout.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--gpu-memory-gib", type=float)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--peak-fp8-tflops", type=float, help="dense fp8 rate (used under "
                        "--fp8-format; the presets know theirs, the A100 has none)")
    parser.add_argument("--peak-fp32-tflops", type=float, help="fp32 matmul rate (the "
                        "--qk-clip score pass, the emulated fp8 GEMMs; the presets know "
                        "theirs, default the bf16 peak)")
    parser.add_argument("--fp8-block-kernel", action=argparse.BooleanOptionalAction,
                        help="the GPU has the 1 x 128 block-scaled fp8 GEMM (Hopper; the "
                        "h100, h800 and h200 presets): --fp8-recipe blockwise runs its e4m3 "
                        "GEMMs with it; without, they are emulated in fp32")
    parser.add_argument("--intra-node-gbps", type=float)
    parser.add_argument("--inter-node-gbps", type=float)
    parser.add_argument("--matmul-efficiency", type=float)
    parser.add_argument("--memory-efficiency", type=float, help="fraction of the memory "
                        "bandwidth the memory-bound work reaches on what the planner counts "
                        "of it (the GPU presets: 0.3, fitted to an H200's steps)")
    parser.add_argument("--megatron-script", help="a launch script whose --flags give the "
                        "model (flags after -- are added after them)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--show-infeasible", type=int, default=5)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--recompute", nargs="*", default=list(RECOMPUTE))
    parser.add_argument("--pipeline-schedules", nargs="*", default=list(SCHEDULES),
                        choices=SCHEDULES,
                        help="--pipeline-schedule values to try: 1f1b / zb_h1 with one "
                             "model chunk per pipeline rank, zbv / dualpipev with two (more "
                             "chunks run interleaved_1f1b)")
    parser.add_argument("--offload-fractions", type=float, nargs="*", default=[0.0, 1.0],
                        help="--optimizer-offload-fraction values to try (0: no offload)")
    for dim in ("tp", "pp", "vpp", "cp", "ep"):
        parser.add_argument(f"--{dim}", type=int, nargs="*",
                            help=f"only these {dim} sizes (default: all that can work)")
    return parser


def plan(argv: list[str]):
    """Parse ``argv`` (this tool's flags, ``--``, the model's) and search: (ranked candidates,
    cluster, parsed tool args)."""
    argv = list(argv)
    model_flags = []
    if "--" in argv:
        k = argv.index("--")
        argv, model_flags = argv[:k], argv[k + 1:]
    parser = _parser()
    args = parser.parse_args(argv)
    check_args(args)
    if args.megatron_script:
        try:
            text = Path(args.megatron_script).read_text()
        except OSError as exc:
            raise ConfigError(f"--megatron-script {args.megatron_script}: cannot read it "
                              f"({exc.strerror or exc})") from None
        flags, skipped = script_flags(text)
        if skipped:
            print(f"note: skipped flags megalite does not know: {' '.join(skipped)}")
        model_flags = flags + model_flags
    tokenizers = [model_flags[i + 1] for i, f in enumerate(model_flags[:-1])
                  if f == "--tokenizer-type"]
    model_flags = drop_flags(strip_layout(model_flags), IO_FLAGS)
    if "--vocab-size" not in model_flags and not any(f == "--config" for f in model_flags):
        vocab = KNOWN_VOCAB.get(tokenizers[-1]) if tokenizers else None
        model_flags += ["--vocab-size", str(vocab or 50257)]
        print(f"note: no --vocab-size given; {tokenizers[-1]} has {vocab} tokens" if vocab
              else "note: no --vocab-size given; assuming GPT-2's 50257 (give --vocab-size "
                   "after --)")
    try:   # the model alone: mock data and the NullTokenizer (a --config file's data
        # settings set aside too)
        base = parse_args(model_flags + ["--tokenizer-type", "NullTokenizer"])
        base.data = replace(base.data, mock_data=True, data_path=None, train_data_path=None,
                            valid_data_path=None, test_data_path=None)
    except ConfigError as exc:
        parser.error(f"the model's flags: {exc}")
    if base.train.global_batch_size is None:
        parser.error("give --global-batch-size after --")
    args.base = base   # the model and batch the search lays out
    cluster = build_cluster(args)
    if base.model.fp8_format is not None and not cluster.fp8_flops:
        parser.error(f"--fp8-format {base.model.fp8_format}: the {cluster.name} GPU has no "
                     "fp8 GEMMs (compute capability 8.9+: --preset h100, h800 or h200), "
                     "or give its rate with --peak-fp8-tflops")
    candidates = search(base, cluster, strategies=tuple(args.strategies),
                        recomputes=tuple(args.recompute),
                        micro_batch_sizes=tuple(args.micro_batch_sizes),
                        offloads=tuple(args.offload_fractions),
                        schedules=tuple(args.pipeline_schedules), tp=args.tp, pp=args.pp,
                        vpp=args.vpp, cp=args.cp, ep=args.ep, progress=True)
    return candidates, cluster, args


def script_argv(path) -> list[str]:
    """The flags a ``examples/planner/*.sh`` script passes to this tool."""
    tokens = shlex.split(Path(path).read_text().replace("\\\n", " "), comments=True)
    return tokens[tokens.index("tools/plan_layout.py") + 1:]


DIMS = ("tp", "pp", "vpp", "cp", "ep")


def left_out(candidates, base, cluster: Cluster, args) -> list[str]:
    """Why each size given with ``--tp/--pp/--vpp/--cp/--ep`` that no candidate has was
    left out: megalite's own validation of a layout with it (the other sizes at their first
    given value, else 1; a pipeline of 2 or more under ``--vpp``), one line each."""
    world = cluster.world_size
    out = []
    for dim in DIMS:
        for value in getattr(args, dim) or ():
            if any(c.sizes[dim] == value for c in candidates):
                continue
            sizes = {d: (getattr(args, d) or [1])[0] for d in DIMS}
            sizes[dim] = value
            if dim == "vpp" and value > 1 and not args.pp:
                sizes["pp"] = next((d for d in range(2, base.model.num_layers + 1)
                                    if base.model.num_layers % d == 0 and world % d == 0), 1)
            try:
                make_config(base, world, sizes, "no_shard", "none",
                            args.micro_batch_sizes[0] if args.micro_batch_sizes else 1)
            except (ConfigError, ValueError) as exc:
                out.append(f"--{dim} {value} on {world} GPUs: {str(exc).splitlines()[0]}")
            else:
                out.append(f"--{dim} {value} on {world} GPUs: no layout with it passes the "
                           f"other choices (--strategies, --offload-fractions, sizes)")
    return out


def main(argv=None) -> int:
    try:
        candidates, cluster, args = plan(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        return report_tool_error(PROG, exc)
    reasons = left_out(candidates, args.base, cluster, args)
    if not candidates:
        why = "; ".join(reasons) or ("the search has no layout to evaluate; widen "
                                     "--strategies / --micro-batch-sizes / sizes")
        print(f"{PROG}: error: no layout to evaluate: {why}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    for line in reasons:
        print(f"note: left out {line}")
    print(report(candidates, cluster, args.top, args.show_infeasible, args.base.model))
    return 0 if any(c.feasible for c in candidates) else 1


if __name__ == "__main__":
    sys.exit(main())
