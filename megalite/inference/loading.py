"""A checkpoint and its tokenizer, ready for generation or evaluation: in one process,
or tensor parallel across the ranks torchrun started (the checkpoint resharded on load,
whatever layout saved it)."""

from __future__ import annotations

import torch

from megalite.config import ConfigError, ParallelConfig
from megalite.data.tokenizers import TokenizerError, build_tokenizer


def apply_tokenizer_flags(data_cfg, args) -> None:
    """Override the checkpoint's recorded tokenizer settings with the flags given."""
    for name in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(data_cfg, name, value)


def check_inference_layout(args) -> None:
    """Refuse the parallelisms generation and evaluation do not run (one line each)."""
    for flag, value in (("--pipeline-model-parallel-size",
                         getattr(args, "pipeline_model_parallel_size", 1)),
                        ("--context-parallel-size", getattr(args, "context_parallel_size", 1))):
        if value != 1:
            raise ConfigError(f"{flag} {value}: inference runs tensor parallel only; use "
                              f"--tensor-model-parallel-size (pipeline and context "
                              f"parallelism are for training)")
    if getattr(args, "sequence_parallel", False):
        raise ConfigError("--sequence-parallel: inference runs tensor parallel without "
                          "sequence parallelism; drop the flag")
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if tp < 1:
        raise ConfigError(f"--tensor-model-parallel-size must be >= 1, got {tp}")


def inference_state(tp: int = 1):
    """The :class:`~megalite.parallel.state.ParallelState` of ``tp`` ranks (CPU, gloo),
    initializing torch.distributed from torchrun's environment when ``tp > 1``; the world
    must be exactly the ``tp`` ranks."""
    from megalite.parallel.state import ParallelState, init_distributed

    world = 1
    if tp > 1:
        _, world = init_distributed("gloo", device="cpu")
    if world != tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} needs {tp} processes, this run "
                          f"has {world}; launch with torchrun --nproc-per-node {tp}")
    return ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp),
                               device=torch.device("cpu"))


def load_model(load: str, iteration: int | None = None, ps=None):
    """(MegaliteConfig, fp32 GPTModel at ``ps``'s tensor parallel size in eval mode) of
    the checkpoint under ``load``; collective over ``ps``'s world."""
    from megalite.checkpoint.consolidated import checkpoint_config, single_process_state
    from megalite.checkpoint.load import load_checkpoint
    from megalite.models.gpt import GPTModel

    ps = ps or single_process_state()
    cfg, iteration = checkpoint_config(load, iteration)
    cfg.model.bf16 = cfg.model.fp16 = False
    heads, groups = cfg.model.num_attention_heads, cfg.model.num_query_groups
    tp = ps.tp.size
    if heads % tp or (groups or heads) % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the model's "
                          f"{heads} attention heads / {groups or heads} query groups; "
                          f"choose a divisor")
    if cfg.model.num_experts and tp > 1:
        raise ConfigError(f"--tensor-model-parallel-size {tp}: MoE models ({cfg.model.num_experts}"
                          f" experts) run inference at tensor parallel size 1 (the MoE layer "
                          f"splits the sequence over tp; a decoding step has one token)")
    model = GPTModel(cfg.model, ps, seed=cfg.train.seed)
    load_checkpoint(load, model, None, None, ps, load_optim=False, load_rng=False,
                    iteration=iteration)
    return cfg, model.eval()


def load_for_inference(load: str, iteration: int | None = None, args=None, ps=None):
    """(MegaliteConfig, GPTModel in eval mode, tokenizer) of the checkpoint under
    ``load`` (any saved layout), at ``ps``'s tensor parallel size (default one process).
    The tokenizer is the one the checkpoint records unless ``args`` names another
    (``--tokenizer-type`` ...); its vocabulary must match the model's."""
    cfg, model = load_model(load, iteration, ps)
    if args is not None:
        apply_tokenizer_flags(cfg.data, args)
    vocab = cfg.model.vocab_size
    if cfg.data.tokenizer_type == "NullTokenizer" or (
            cfg.data.tokenizer_type is None and cfg.data.mock_data):
        vocab -= 1  # NullTokenizer(n) has n + 1 tokens (its eod); training recorded n + 1
    tokenizer = build_tokenizer(cfg.data, vocab)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise TokenizerError(
            f"the tokenizer {tokenizer!r} has {tokenizer.vocab_size} tokens but the "
            f"checkpoint's model has a vocabulary of {cfg.model.vocab_size}; pass the "
            f"tokenizer the model was trained with")
    return cfg, model, tokenizer
