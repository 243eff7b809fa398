#!/usr/bin/env python
"""Convert checkpoints between Hugging Face ``transformers``, Megatron-LM and megalite.

    # HF (config.json + *.safetensors) -> a megalite checkpoint; prints the flags to train on
    python tools/convert_checkpoint.py --source hf --target megalite \\
        --load-dir llama-hf --save-dir llama-megalite --target-tensor-parallel-size 2
    # megalite (latest or --ckpt-step N) -> HF, loadable with AutoModelForCausalLM
    python tools/convert_checkpoint.py --source megalite --target hf \\
        --load-dir runs/ckpt --save-dir llama-hf-out --dtype bf16
    # megalite -> one full state dict for inspection (torch.save, or --format safetensors)
    python tools/convert_checkpoint.py --source megalite --target megalite-consolidated \\
        --load-dir runs/ckpt --save-dir full/
    # Megatron-LM torch_dist or legacy mp_rank_* (latest or --ckpt-step N, any tp/pp) -> megalite;
    # with the optimizer state Megatron saved (per parameter or in the distributed
    # optimizer's buckets), a checkpoint that resumes
    python tools/convert_checkpoint.py --source megatron --target megalite \\
        --load-dir megatron-ckpt --save-dir llama-megalite
    # megalite -> Megatron-Core torch_dist, with the optimizer state Megatron-LM resumes from
    python tools/convert_checkpoint.py --source megalite --target megatron \\
        --load-dir runs/ckpt --save-dir megatron-ckpt --target-optimizer-format distributed

Families: GPT-2, Llama (GQA, tied or untied embeddings; megalite rotates in HF's
rotate-half layout, so q/k need no permutation), Mixtral (experts stacked ``[E, ...]``;
hub ``w1/w2/w3`` files or transformers' fused names), Qwen3 (Llama's with q/k norms),
Qwen3-MoE (dense and sparse layers, ``norm_topk_prob``), DeepSeek-V3 (multi-latent
attention, routed and shared experts, the router's correction bias; the hub's
multi-token-prediction layers as ``--mtp-num-layers`` depths) and DeepSeek-V2 / V2-Lite
(the same layers with softmax routing, ``--moe-router-pre-softmax``): one spec each in
megalite.models.families, which the converter asks for names, configs and architectures.
Megatron-LM checkpoints map through megalite.checkpoint.megatron (Megatron-Core's sharded
keys, its per-group q/k/v interleave, the config from the saved ``args``, the optimizer
state both ways), in ``convert_megatron.py`` beside this file.

A megalite checkpoint is layout-free (it reshards on load), so the converter writes one
weights-only checkpoint (iteration 0) and records the config; the target tensor /
pipeline / expert parallel sizes are only checked against the model and appear in the
printed ``pretrain_gpt.py`` flags. Continue training with ``--load DIR --finetune``.

Tokenizers travel along: HF -> megalite copies the source's tokenizer files into
``SAVE/tokenizer/`` (megalite.checkpoint.tokenizer_dir), which generate, evaluate, the
server and ``--load`` use when no tokenizer flag names one; megalite -> HF writes the
tokenizer the checkpoint records or carries (or the tokenizer flags name) as Hugging Face
files (megalite.data.tokenizer_export), with the bos/eos ids config.json gets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

import torch

from megalite.config import ConfigError, MegaliteConfig, ModelConfig, ParallelConfig
from megalite.errors import exit_code_of
from megalite.models.families import FamilySpec, family_for_hf, family_of
from megalite.models.families.spec import trained_token_ids
from tools.conversion import ConversionError, progress, training_flags
from tools.convert_megatron import megalite_to_megatron, megatron_to_megalite

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFE_INDEX = "model.safetensors.index.json"


# -- Hugging Face files ----------------------------------------------------------------------
def read_hf_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards its index names."""
    from safetensors.torch import load_file

    index = os.path.join(directory, SAFE_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"{directory} holds neither model.safetensors nor {SAFE_INDEX}")
    state = {}
    for name in progress(files, "read safetensors", "file"):
        state.update(load_file(os.path.join(directory, name)))
    return state


def parse_size(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def write_hf_weights(state: dict[str, torch.Tensor], directory: str, max_shard: int) -> list:
    """safetensors files as ``save_pretrained`` writes them: one ``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
    for name, shard in progress(list(zip(names, shards)), "write safetensors", "file"):
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in state.values())},
                 "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
        with open(os.path.join(directory, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return names


def unused_hf_tensors(spec: FamilySpec, hf_state: dict[str, torch.Tensor],
                      full: dict[str, torch.Tensor], model_cfg: ModelConfig) -> list[str]:
    """Names in ``hf_state`` that converting ``full`` back would not write, in either the
    in-memory or the hub-file naming, and that are no buffer the family may drop."""
    in_memory = spec.to_hf(full, model_cfg)
    written = set(in_memory) | set(spec.to_hub_names(in_memory, model_cfg))
    return sorted(k for k in set(hf_state) - written
                  if not k.endswith(spec.ignored_hf_suffixes))


# -- conversions -------------------------------------------------------------------------------
def hf_to_megalite(args) -> None:
    from megalite.checkpoint.consolidated import save_full_model

    hf_cfg = read_hf_config(args.load_dir)
    try:
        spec = family_for_hf(getattr(hf_cfg, "model_type", None))
        kwargs = spec.config_from_hf(hf_cfg)
    except ValueError as exc:
        raise ConversionError(f"cannot convert {args.load_dir}: {exc}") from None
    for warning in spec.conversion_warnings(hf_cfg):
        print(f"warning: {args.load_dir}: {warning}")
    cfg = MegaliteConfig(model=ModelConfig(**kwargs), parallel=ParallelConfig(
        tensor_model_parallel_size=args.target_tensor_parallel_size,
        pipeline_model_parallel_size=args.target_pipeline_parallel_size))
    world = args.target_tensor_parallel_size * args.target_pipeline_parallel_size
    try:
        cfg.validate(world)
    except ConfigError as exc:
        raise ConfigError(f"the target layout does not fit the model: {exc}") from None
    tokenizer_source = import_tokenizer(args, cfg)
    hf_state = read_hf_weights(args.load_dir)
    cfg.model, note = spec.fit_to_weights(cfg.model, hf_state)
    if note:
        print(f"note: {args.load_dir}: {note}")
    dropped, why = spec.dropped_hf_tensors(hf_state, cfg.model)
    if dropped:
        print(f"note: dropped {len(dropped)} tensors of {args.load_dir}: {why}")
        drop = set(dropped)
        hf_state = {k: v for k, v in hf_state.items() if k not in drop}
    with progress(2, "convert", "step") as bar:
        full = spec.from_hf(hf_state, cfg.model)
        unused = unused_hf_tensors(spec, hf_state, full, cfg.model)
        if unused:
            raise ConversionError(f"{len(unused)} tensors of {args.load_dir} have no "
                                  f"megalite counterpart, e.g. {unused[:3]}")
        bar.update(1)
        bar.set_postfix_str("saving the checkpoint")
        carried = None
        if tokenizer_source is not None:   # before the checkpoint, whose pointer is last
            from megalite.checkpoint.tokenizer_dir import TOKENIZER_DIR, write_tokenizer_dir

            names = write_tokenizer_dir(args.save_dir, tokenizer_source)
            carried = os.path.join(args.save_dir, TOKENIZER_DIR)
        path = save_full_model(cfg, full, args.save_dir)
        bar.update(1)
    flags = training_flags(cfg)
    print(f"wrote {path} ({spec.name}, {sum(t.numel() for t in full.values()):,} parameters)")
    if carried is not None:
        print(f"wrote {carried} ({', '.join(names)} of {tokenizer_source}): generate, "
              f"evaluate and the server use it without tokenizer flags")
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", carried]
    print("continue training with:\n  pretrain/pretrain_gpt.py " + " ".join(flags)
          + f" --load {args.save_dir} --finetune --save <dir> ...")


def import_tokenizer(args, cfg: MegaliteConfig) -> str | None:
    """The directory whose tokenizer the converted checkpoint will carry (``--tokenizer-model``,
    else the Hugging Face source), ``cfg.data`` set to a HuggingFaceTokenizer; None, with a
    note, when there is none or it cannot be used with the model."""
    from megalite.checkpoint.tokenizer_dir import tokenizer_files
    from megalite.data.tokenizers import HuggingFaceTokenizer, TokenizerError

    source = args.tokenizer_model or args.load_dir
    if not tokenizer_files(source):
        print(f"note: {source} holds no tokenizer files, so the converted checkpoint "
              f"carries none: give generate / evaluate / the server --tokenizer-type "
              f"HuggingFaceTokenizer --tokenizer-model <dir>, or convert again with "
              f"--tokenizer-model <dir of the model's tokenizer>")
        return None
    try:
        tokenizer = HuggingFaceTokenizer(source)
    except TokenizerError as exc:
        print(f"warning: the converted checkpoint carries no tokenizer: {exc}")
        return None
    if tokenizer.vocab_size > cfg.model.vocab_size:
        print(f"warning: the converted checkpoint carries no tokenizer: {source}'s "
              f"tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
              f"vocabulary of {cfg.model.vocab_size}")
        return None
    cfg.data.tokenizer_type = "HuggingFaceTokenizer"   # the model: the one it carries
    return source


def read_hf_config(directory: str):
    """The ``transformers`` config of ``directory``; one-line ``ConversionError`` when it is
    not a Hugging Face checkpoint."""
    from transformers import AutoConfig

    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise ConversionError(f"{directory}: the directory {what}")
    if not os.path.exists(os.path.join(directory, "config.json")):
        from megalite.checkpoint.megatron.files import TRACKER

        hint = ""
        if os.path.exists(os.path.join(directory, TRACKER)):
            hint = " (it looks like a Megatron-LM or megalite checkpoint: use --source " \
                   "megatron or --source megalite)"
        raise ConversionError(f"{directory} is not a Hugging Face checkpoint: it has no "
                              f"config.json{hint}")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConversionError(f"{directory}/config.json is not a usable Hugging Face config: "
                              f"{first}") from None


def megalite_to_hf(args) -> None:
    from megalite.checkpoint.consolidated import load_full_model

    with progress(2, "convert", "step") as bar:
        bar.set_postfix_str("loading the checkpoint")
        cfg, model = load_full_model(args.load_dir, args.ckpt_step)
        bar.update(1)
        try:
            spec = family_of(cfg.model)
        except ValueError as exc:
            raise ConversionError(f"cannot convert {args.load_dir}: {exc}") from None
        state = spec.to_hf(model.full_state_dict(), cfg.model)
        bar.update(1)
    for warning in spec.export_warnings(cfg.model):
        print(f"warning: {args.load_dir}: {warning}")
    if not cfg.model.untie_embeddings_and_output_weights:
        state.pop("lm_head.weight", None)   # tied: transformers re-ties it on load
    state = spec.to_hub_names(state, cfg.model)  # the names save_pretrained writes
    dtype = DTYPES[args.dtype]
    state = {k: v.float() if k.endswith(spec.fp32_hf_suffixes) else v.to(dtype)
             for k, v in state.items()}
    os.makedirs(args.save_dir, exist_ok=True)
    files = write_hf_weights(state, args.save_dir, parse_size(args.max_shard_size))
    tokenizer = export_tokenizer(cfg, args)
    hf_cfg = spec.hf_config(cfg.model, None if tokenizer is None else
                            trained_token_ids(tokenizer))
    hf_cfg.architectures = [spec.hf_architecture]
    hf_cfg.dtype = str(dtype).removeprefix("torch.")
    hf_cfg.save_pretrained(args.save_dir)
    tokenizer_files = write_export_tokenizer(tokenizer, args.save_dir)
    print(f"wrote {args.save_dir}: config.json + {len(files)} safetensors file(s) "
          f"({spec.name}, {args.dtype}){tokenizer_files}")


def export_tokenizer(cfg, args):
    """The tokenizer of an export: the tokenizer flags', else the one the checkpoint's
    config records, else the one it carries (``tokenizer/``). None when there is none
    (a note says how to add one) and, with a warning, when it cannot be read here:
    config.json then keeps the architecture's bos/eos ids where they are ids of the
    vocabulary."""
    from megalite.data.tokenizers import TokenizerError
    from megalite.inference.loading import checkpoint_tokenizer

    d = cfg.data
    if (d.tokenizer_type is None and not d.mock_data
            and args.tokenizer_type is None and args.tokenizer_model is None):
        from megalite.checkpoint.tokenizer_dir import carried_tokenizer

        if carried_tokenizer(args.load_dir) is None:
            print(f"note: {args.save_dir} gets no tokenizer: {args.load_dir} records and "
                  f"carries none; export again with the tokenizer the model was trained "
                  f"with (--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>, or "
                  f"its --tokenizer-type and --tokenizer-model / --vocab-file --merge-file)")
            return None
    try:
        return checkpoint_tokenizer(cfg, args.load_dir, args)
    except TokenizerError as exc:
        print(f"warning: {args.load_dir}: config.json gets no bos/eos ids of the tokenizer "
              f"the model was trained with, and {args.save_dir} no tokenizer files, as it "
              f"cannot be read here ({exc}); export again with --tokenizer-model (and "
              f"--tokenizer-type) naming it, or set bos_token_id / eos_token_id by hand")
        return None


def write_export_tokenizer(tokenizer, out: str) -> str:
    """Write ``tokenizer``'s Hugging Face files to ``out``; the words the summary line
    adds (a note instead when there are none)."""
    from megalite.data.tokenizer_export import NotExportable, save_hf_tokenizer
    from megalite.data.tokenizers import NullTokenizer, TokenizerError

    if tokenizer is None:
        return ", no tokenizer"
    if isinstance(tokenizer, NullTokenizer):
        print(f"note: {out} gets no tokenizer files: the model was trained on mock data "
              f"(NullTokenizer, token ids as text)")
        return ", no tokenizer"
    try:
        names = save_hf_tokenizer(tokenizer, out)
    except NotExportable as exc:
        print(f"note: {out} gets no tokenizer files: {exc}; save the tokenizer there with "
              f"transformers yourself")
        return ", no tokenizer"
    except TokenizerError as exc:
        print(f"warning: {exc}")
        return ", a tokenizer that differs (see the warning)"
    return " + " + ", ".join(names)


def megalite_to_consolidated(args) -> None:
    from megalite.checkpoint.consolidated import load_full_model

    with progress(1, "load", "step") as bar:
        cfg, model = load_full_model(args.load_dir, args.ckpt_step)
        bar.update(1)
    full = {k: v.to(DTYPES[args.dtype]).contiguous() for k, v in model.full_state_dict().items()}
    os.makedirs(args.save_dir, exist_ok=True)
    if args.format == "safetensors":
        from safetensors.torch import save_file

        path = os.path.join(args.save_dir, "model.safetensors")
        save_file(full, path, metadata={"format": "pt"})
    else:
        path = os.path.join(args.save_dir, "model.pt")
        torch.save(full, path)
    with open(os.path.join(args.save_dir, "megalite_config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    print(f"wrote {path} ({len(full)} tensors) and megalite_config.json")


def _size(text: str) -> int:
    """A parallel size: an integer >= 1 (argparse turns the error into one usage line)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parallel size: give an integer "
                                         ">= 1")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """This tool's flags; a pair of --source and --target that is no conversion is a usage
    error (exit 2)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=("hf", "megalite", "megatron"), required=True)
    p.add_argument("--target", choices=("megalite", "hf", "megalite-consolidated",
                                        "megatron"), required=True)
    p.add_argument("--load-dir", "--load", dest="load_dir", required=True,
                   help="Source directory (--load, as the other tools spell it).")
    p.add_argument("--save-dir", "--save", dest="save_dir", required=True,
                   help="Output directory (--save, as the other tools spell it).")
    p.add_argument("--ckpt-step", type=int, help="megalite or Megatron source: this "
                   "iteration instead of the latest.")
    p.add_argument("--iteration", type=int, dest="ckpt_step", help=argparse.SUPPRESS)
    p.add_argument("--target-tensor-parallel-size", type=_size, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=_size, default=1)
    p.add_argument("--target-expert-model-parallel-size", type=_size, default=None,
                   help="megalite -> Megatron, MoE: the Megatron run's "
                   "--expert-model-parallel-size; above 1 its experts have an optimizer of "
                   "their own, whose state is written apart (default: the megalite run's; an "
                   "import of a Megatron run keeps none: give it).")
    p.add_argument("--no-load-optim", action="store_true",
                   help="Megatron <-> megalite: the weights alone (continue with "
                   "--finetune), not the optimizer state the source saved.")
    p.add_argument("--target-optimizer-format", choices=("distributed", "plain"),
                   help="megalite -> Megatron: write the optimizer state for a Megatron-LM "
                   "run with (distributed: the fully_reshardable format) or without "
                   "--use-distributed-optimizer (default: as the megalite run sharded its "
                   "optimizer).")
    p.add_argument("--transformer-impl", choices=("transformer_engine", "local"),
                   help="megalite -> Megatron: the layer spec the Megatron run builds "
                   "(Megatron-LM's flag), whose names the norms are written under "
                   "(default: the one the checkpoint's config records, else "
                   "transformer_engine, Megatron-LM's default).")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="HF / consolidated output precision.")
    p.add_argument("--max-shard-size", default="5GB", help="HF output: safetensors shard "
                   "size (e.g. 5GB, 500MB).")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch",
                   help="megalite-consolidated output file format.")
    from megalite.config.data import TOKENIZER_TYPES

    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="megalite -> HF: the "
                   "tokenizer to export (default: the one the checkpoint records or "
                   "carries).")
    p.add_argument("--tokenizer-model", help="HF -> megalite: the tokenizer directory the "
                   "checkpoint carries (default: the source's); megalite -> HF: the "
                   "tokenizer's model file or directory.")
    p.add_argument("--vocab-file", help="megalite -> HF, GPT2BPETokenizer: vocab.json.")
    p.add_argument("--merge-file", help="megalite -> HF, GPT2BPETokenizer: merges.txt.")
    args = p.parse_args(argv)
    if (args.source, args.target) not in CONVERSIONS:
        p.error(f"--source {args.source} --target {args.target} is not a conversion")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    convert = CONVERSIONS[(args.source, args.target)]
    try:
        convert(args)
    except Exception as exc:
        code = exit_code_of(exc)
        if code is None:
            raise
        if os.environ.get("MEGALITE_TRACEBACK") == "1":
            import traceback

            traceback.print_exc()
        print(f"convert_checkpoint: error: {exc}", file=sys.stderr)
        return code
    return 0


CONVERSIONS = {("hf", "megalite"): hf_to_megalite, ("megalite", "hf"): megalite_to_hf,
               ("megalite", "megalite-consolidated"): megalite_to_consolidated,
               ("megatron", "megalite"): megatron_to_megalite,
               ("megalite", "megatron"): megalite_to_megatron}


if __name__ == "__main__":
    sys.exit(main())
