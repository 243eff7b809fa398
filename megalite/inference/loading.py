"""A checkpoint and its tokenizer, ready for generation or evaluation in one process."""

from __future__ import annotations

from megalite.data.tokenizers import TokenizerError, build_tokenizer


def apply_tokenizer_flags(data_cfg, args) -> None:
    """Override the checkpoint's recorded tokenizer settings with the flags given."""
    for name in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(data_cfg, name, value)


def load_for_inference(load: str, iteration: int | None = None, args=None):
    """(MegaliteConfig, GPTModel at tp=1 in eval mode, tokenizer) of the checkpoint under
    ``load`` (any saved layout). The tokenizer is the one the checkpoint records unless
    ``args`` names another (``--tokenizer-type`` ...); its vocabulary must match the
    model's."""
    from megalite.checkpoint.consolidated import load_full_model

    cfg, model = load_full_model(load, iteration)
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
    return cfg, model.eval(), tokenizer
