"""A checkpoint and its tokenizer, ready for generation or evaluation: in one process,
or tensor / pipeline / expert parallel across the ranks torchrun started (the checkpoint
resharded on load, whatever layout saved it)."""

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


def _size(args, name: str, default=1):
    value = getattr(args, name, default)
    return default if value is None else value


def check_inference_layout(args) -> None:
    """Refuse the parallelisms generation and evaluation do not run, and sizes below 1
    (one line each)."""
    cp = _size(args, "context_parallel_size")
    if cp != 1:
        raise ConfigError(f"--context-parallel-size {cp}: inference runs tensor, pipeline "
                          f"and expert parallel, not context parallel; drop the flag")
    if getattr(args, "sequence_parallel", False):
        raise ConfigError("--sequence-parallel: inference runs tensor parallel without "
                          "sequence parallelism; drop the flag")
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size"):
        value = _size(args, flag)
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def inference_state(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                    timeout_minutes: float = 10):
    """The :class:`~megalite.parallel.state.ParallelState` of ``tp x pp`` ranks (CPU,
    gloo; experts over ``ep x etp``, which must divide tp), initializing
    torch.distributed from torchrun's environment when more than one; the world must be
    exactly the ``tp x pp`` ranks. ``timeout_minutes``: of every collective (a server's
    other ranks wait in one for the next request)."""
    from megalite.parallel.state import ParallelState, init_distributed

    etp = tp if etp is None else etp
    if ep * etp > 1 and tp % (ep * etp):
        raise ConfigError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                          f"{etp} must divide --tensor-model-parallel-size {tp} (inference "
                          f"has no data parallel ranks)")
    world, need = 1, tp * pp
    if need > 1:
        _, world = init_distributed("gloo", timeout_minutes=timeout_minutes, device="cpu")
    if world != need:
        sizes = (f"--tensor-model-parallel-size {tp}" if pp == 1 else
                 f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
        raise ConfigError(f"{sizes} needs {need} processes, this run has {world}; launch "
                          f"with torchrun --nproc-per-node {need}")
    return ParallelState.build(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                       distributed_timeout_minutes=timeout_minutes),
        device=torch.device("cpu"))


def state_for_args(args, timeout_minutes: float = 10):
    """:func:`inference_state` for the load flags (``tools/generate.py``'s)."""
    check_inference_layout(args)
    return inference_state(_size(args, "tensor_model_parallel_size"),
                           _size(args, "pipeline_model_parallel_size"),
                           _size(args, "expert_model_parallel_size"),
                           getattr(args, "expert_tensor_parallel_size", None),
                           timeout_minutes)


def _stage_layers(cfg, ps) -> tuple[int, int]:
    """(first global layer, number of layers) of this rank's pipeline stage: as the
    checkpoint's training split them when it ran the same pipeline size (its
    ``--decoder-first/last-pipeline-num-layers`` included), else equally."""
    from megalite.config.layout import chunk_layer_ranges

    pp, num_layers, p = ps.pp.size, cfg.model.num_layers, cfg.parallel
    first = last = None
    if pp == p.pipeline_model_parallel_size:
        first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is None and last is None and num_layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} does not divide the model's "
                          f"{num_layers} layers; choose a divisor")
    return chunk_layer_ranges(num_layers, pp, None, first, last)[ps.pp.rank][0]


def load_model(load: str, iteration: int | None = None, ps=None):
    """(MegaliteConfig, fp32 GPTModel in eval mode) of the checkpoint under ``load``, at
    ``ps``'s tensor / expert parallel sizes; under pipeline parallelism this rank's
    stage (its layers, the embedding on the first, the output layer on the last).
    Collective over ``ps``'s world."""
    from megalite.checkpoint.consolidated import checkpoint_config, single_process_state
    from megalite.checkpoint.load import LoadOptions, load_checkpoint
    from megalite.models.gpt import GPTModel

    ps = ps or single_process_state()
    if ps.v_shape:
        raise ConfigError("--pipeline-schedule zbv / dualpipev are training schedules; "
                          "inference runs one chunk per pipeline stage: drop the flag (their "
                          "checkpoints load at any pipeline size)")
    cfg, iteration = checkpoint_config(load, iteration)
    cfg.model.bf16 = cfg.model.fp16 = False
    heads, groups = cfg.model.num_attention_heads, cfg.model.num_query_groups
    tp = ps.tp.size
    if heads % tp or (groups or heads) % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the model's "
                          f"{heads} attention heads / {groups or heads} query groups; "
                          f"choose a divisor")
    experts = cfg.model.num_experts
    if (ps.ep.size > 1 or ps.etp.size != tp) and not experts:
        raise ConfigError(f"--expert-model-parallel-size {ps.ep.size} / "
                          f"--expert-tensor-parallel-size {ps.etp.size}: the model has no "
                          f"experts; drop the flags")
    if experts and experts % ps.ep.size:
        raise ConfigError(f"--expert-model-parallel-size {ps.ep.size} does not divide the "
                          f"model's {experts} experts; choose a divisor")
    first, num_layers = _stage_layers(cfg, ps)
    model = GPTModel(cfg.model, ps, seed=cfg.train.seed,
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), first_layer=first,
                     num_layers=num_layers)
    load_checkpoint(load, model, None, None, ps,
                    LoadOptions(load_optim=False, load_rng=False, iteration=iteration))
    return cfg, model.eval()


def load_for_inference(load: str, iteration: int | None = None, args=None, ps=None):
    """(MegaliteConfig, GPTModel in eval mode, tokenizer) of the checkpoint under
    ``load`` (any saved layout), at ``ps``'s layout (default one process).
    The tokenizer is the one the checkpoint records unless ``args`` names another
    (``--tokenizer-type`` ...); its vocabulary must match the model's."""
    cfg, model = load_model(load, iteration, ps)
    return cfg, model, checkpoint_tokenizer(cfg, load, args)


def checkpoint_tokenizer(cfg, root: str | None = None, args=None):
    """The tokenizer a checkpoint's config records (``cfg.data``: its type and files) for
    its model's vocabulary, or, when it records none (or a Hugging Face tokenizer directory
    that is gone), the one the checkpoint under ``root`` carries (``root/tokenizer``,
    :mod:`megalite.checkpoint.tokenizer_dir`); the tokenizer flags of ``args`` override
    either. ``cfg.data`` is left naming the tokenizer built. :class:`TokenizerError` when
    it cannot be built or its vocabulary is not the model's (a carried Hugging Face
    tokenizer may have fewer tokens than the model's embedding: Hugging Face models often
    pad it)."""
    from megalite.checkpoint.tokenizer_dir import use_carried_tokenizer

    carried = use_carried_tokenizer(cfg.data, root, replace_missing=True)
    if args is not None:
        apply_tokenizer_flags(cfg.data, args)
    carried = carried if cfg.data.tokenizer_model == carried else None
    vocab = cfg.model.vocab_size
    if cfg.data.tokenizer_type == "NullTokenizer" or (
            cfg.data.tokenizer_type is None and cfg.data.mock_data):
        vocab -= 1  # NullTokenizer(n) has n + 1 tokens (its eod); training recorded n + 1
    tokenizer = build_tokenizer(cfg.data, vocab)
    if tokenizer.vocab_size != cfg.model.vocab_size and not (
            carried and tokenizer.vocab_size < cfg.model.vocab_size):
        raise TokenizerError(
            f"the tokenizer {tokenizer!r} has {tokenizer.vocab_size} tokens but the "
            f"checkpoint's model has a vocabulary of {cfg.model.vocab_size}; pass the "
            f"tokenizer the model was trained with")
    return tokenizer
