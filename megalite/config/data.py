"""Data sources, splits and tokenizer settings."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import ConfigError, arg, check_choices, require


@dataclass
class DataConfig:
    data_path: list | None = arg(None, "Dataset prefixes, optionally weighted: "
                                    "'0.3 prefixA 0.7 prefixB'.", nargs="*")
    train_data_path: list | None = arg(None, "Training-only prefixes.", nargs="*")
    valid_data_path: list | None = arg(None, "Validation-only prefixes.", nargs="*")
    test_data_path: list | None = arg(None, "Test-only prefixes.", nargs="*")
    split: str = arg("969,30,1", "Train,valid,test split of the documents.")
    data_cache_path: str | None = arg(None, "Where to cache the dataset indices.")
    mock_data: bool = arg(False, "Use synthetic data.")
    tokenizer_type: str | None = arg(None, "Tokenizer.", choices=(
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
        "GPT2BPETokenizer", "NullTokenizer"))
    tokenizer_model: str | None = arg(None, "Tokenizer model file or directory.")
    vocab_file: str | None = arg(None, "Vocabulary file (GPT2BPETokenizer).")
    merge_file: str | None = arg(None, "BPE merges file (GPT2BPETokenizer).")
    num_workers: int = arg(0, "Data-loader worker processes.")
    reset_position_ids: bool = arg(False, "Restart position ids at each document.")
    reset_attention_mask: bool = arg(False, "Do not attend across documents.")
    eod_mask_loss: bool = arg(False, "Do not compute the loss on end-of-document tokens.")

    def __post_init__(self) -> None:
        check_choices(self)
        require(self.num_workers >= 0, "num_workers must be >= 0")
        parts = self.split.replace("/", ",").split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, "
                              f"got {self.split!r}") from None
        require(all(v >= 0 for v in values) and sum(values) > 0 and len(values) <= 3,
                 f"--split must have up to 3 non-negative weights with a positive sum, "
                 f"got {self.split!r}")
