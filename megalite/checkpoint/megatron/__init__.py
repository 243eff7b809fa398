"""Megatron-LM / Megatron-Core checkpoints: read into megalite and written back.

:func:`read_megatron` reads one iteration of a Megatron-Core ``torch_dist`` checkpoint
(:mod:`.files`) or of a legacy per-rank one (:mod:`.legacy`), saved at any tp / pp / ep,
in this process (no torch.distributed): the model configuration from the saved ``args``
(:mod:`.arguments`), every weight as one full (tp = pp = 1) tensor in megalite's names
(:mod:`.mapping`), and the optimizer state where Megatron saved it per parameter, in the
distributed optimizer's buckets, or in legacy rank files (by index, or in their
``distrib_optim.pt`` buffers) (:mod:`.optimizer`, :mod:`.buckets`,
:mod:`.legacy_optimizer`). The converter
(``tools/convert_checkpoint.py --source megatron``) writes the result as a megalite
checkpoint with :func:`megalite.checkpoint.consolidated.save_full_model`; :mod:`.writer`
writes the other way (``--target megatron``), with the optimizer state
(:func:`.optimizer.to_megatron_optimizer`) that Megatron-LM resumes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.megatron import arguments, buckets, mapping, optimizer
from megalite.checkpoint.megatron.optimizer import MegatronOptimizerState
from megalite.checkpoint.megatron.files import (
    MegatronCheckpoint,
    find_checkpoint,
    read_common,
    read_objects,
    read_tensors,
    tensor_shapes,
)

SUPPORTED = ("Megatron-Core torch_dist and legacy per-rank checkpoints of GPT models "
             "(GPT-2, Llama, Qwen3, multi-latent attention; MoE as Mixtral, Qwen3-MoE, "
             "DeepSeek-V3), with multi-token prediction depths")


@dataclass
class MegatronImport:
    """A Megatron checkpoint read whole: megalite's config, the full state dict (fp32,
    names as ``GPTModel.full_state_dict()``), the source iteration and remarks, and, where
    it was saved in a per-parameter format, the optimizer state (:mod:`.optimizer`)."""

    cfg: object
    state: dict[str, torch.Tensor]
    source: MegatronCheckpoint
    notes: list[str] = field(default_factory=list)
    optimizer: MegatronOptimizerState | None = None


def read_megatron(root: str, step: int | None = None, load_optim: bool = True
                  ) -> MegatronImport:
    """Read iteration ``step`` (default the latest) of the Megatron checkpoint ``root``,
    with its optimizer state unless ``load_optim`` is False (or it holds none, or one in a
    format megalite cannot read: a note says so); ``CheckpointError`` in one line for
    what megalite cannot import."""
    from megalite.config import (
        ConfigError,
        DataConfig,
        MegaliteConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )

    ckpt = find_checkpoint(root, step)
    if ckpt.format == "legacy":
        from megalite.checkpoint.megatron.legacy import read_legacy

        common, tensors, chunks = read_legacy(ckpt, load_optim)
        keys = list(tensors)
    else:
        common = read_common(ckpt)
        shapes = tensor_shapes(ckpt)
        keys = list(shapes)
        chunks = {k: v[1] for k, v in shapes.items()}
    args = common["args"]
    problems = arguments.unsupported(args)
    unknown = mapping.unknown_keys(keys)
    if unknown:
        problems.append(f"{len(unknown)} tensors with no megalite counterpart, e.g. "
                        f"{', '.join(unknown[:3])}")
    if problems:
        raise CheckpointError(f"cannot import {ckpt.directory}: {'; '.join(problems)}; "
                              f"megalite imports {SUPPORTED}")
    try:
        model = ModelConfig(**arguments.model_kwargs(args))
        cfg = MegaliteConfig(model=model, data=DataConfig(**arguments.data_kwargs(args)),
                             optim=OptimConfig(**arguments.optim_kwargs(
                                 args, optimizer.lion_betas(common))),
                             train=TrainConfig(**arguments.train_kwargs(args)),
                             parallel=ParallelConfig(**arguments.parallel_kwargs(args)))
        cfg.validate(1)
    except (ConfigError, ValueError, TypeError) as exc:
        raise CheckpointError(f"cannot import {ckpt.directory}: its args give no valid "
                              f"megalite model: {exc}") from None
    padded = getattr(args, "padded_vocab_size", None)
    if padded is not None and model.vocab_size > padded:
        raise CheckpointError(f"{ckpt.directory}: vocabulary {model.vocab_size} exceeds the "
                              f"saved padded vocabulary {padded}")
    notes = []
    if getattr(args, "tokenizer_type", None) != arguments.NULL_TOKENIZER:
        notes += _tokenizer_vocab(cfg, padded)
    optim_keys = optimizer.optimizer_keys(keys)
    keys = [k for k in keys if mapping.is_model_key(k)]
    if ckpt.format != "legacy":
        tensors = read_tensors(ckpt, keys)
    state = mapping.to_megalite({k: tensors[k] for k in keys}, chunks, model)
    saved = common.get("optimizer_saved", "optimizer" in common) or bool(optim_keys)
    why = (common.get("optimizer_unreadable") or optimizer.unreadable(common, optim_keys)
           if load_optim else None)
    state_of_optimizer = None
    if saved and load_optim and why is None:
        if ckpt.format == "legacy":   # (placed by name and merged by legacy.read_legacy)
            groups, optim_tensors = [], {k: tensors[k] for k in optim_keys}
        else:
            groups = [g for saved_groups in read_objects(ckpt, buckets.GROUPS)
                      for part in saved_groups for g in part.get("param_groups", [])]
            optim_tensors = read_tensors(ckpt, optim_keys)
        state_of_optimizer = optimizer.read_optimizer_state(
            common, optim_tensors, chunks, model, tensors, groups, ckpt.directory)
        trained = {k for k in state if not k.endswith("expert_bias")}   # buffers: none
        if set(state_of_optimizer.params) != trained:
            odd = sorted(set(state_of_optimizer.params) ^ trained)
            raise CheckpointError(f"{ckpt.directory}: the optimizer state's parameters are "
                                  f"not the model's (e.g. {', '.join(odd[:3])})")
        dtype = (torch.bfloat16 if model.bf16 else torch.float16 if model.fp16
                 else torch.float32)
        misplaced = optimizer.misplaced_masters(state_of_optimizer.params, state, dtype)
        if misplaced:
            state_of_optimizer = None
            notes.append(f"the optimizer state is not imported: its main parameters are not "
                         f"the saved weights ({misplaced}), so its moments are misplaced too "
                         f"(Megatron-Core 0.19.2 writes such files with "
                         f"--dist-ckpt-optim-fully-reshardable at tensor parallel 2 with "
                         f"several gradient buckets, and resumes wrongly from them itself); "
                         f"save the run again without that flag, or continue from the weights "
                         f"with --finetune")
    elif saved:
        notes.append("the optimizer state is not imported "
                     f"({'--no-load-optim' if why is None else why}): continue with "
                     "--finetune")
    return MegatronImport(cfg, state, ckpt, notes, state_of_optimizer)


def _tokenizer_vocab(cfg, padded: int | None) -> list[str]:
    """Set ``cfg.model.vocab_size`` to the size of the tokenizer the args name, when its
    files can be read here (the rows past it are Megatron's padding); otherwise keep the
    padded size and say so."""
    from megalite.data.tokenizers import build_tokenizer

    try:
        size = build_tokenizer(cfg.data).vocab_size
    except Exception as exc:  # files absent on this machine, a type megalite lacks, ...
        return [f"the tokenizer cannot be built here ({str(exc).splitlines()[0]}), so the "
                f"vocabulary keeps Megatron's {cfg.model.vocab_size} padded rows; convert "
                f"where the tokenizer files are, or train with a tokenizer of that size"]
    if padded is not None and size > padded:
        raise CheckpointError(f"the tokenizer has {size} tokens, more than the "
                              f"checkpoint's {padded} embedding rows")
    cfg.model.vocab_size = size
    return []


__all__ = ["MegatronImport", "SUPPORTED", "read_megatron"]
