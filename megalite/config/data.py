"""Data sources, splits and tokenizer settings."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import ConfigError, arg, check_choices, require

# --tokenizer-type values (megalite.data.tokenizers builds each)
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "NullTokenizer")


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
    tokenizer_type: str | None = arg(None, "Tokenizer.", choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = arg(None, "Tokenizer model file or directory "
                                      "(TikTokenizer: a .json or .tiktoken rank file).")
    vocab_file: str | None = arg(None, "Vocabulary file (GPT2BPETokenizer).")
    merge_file: str | None = arg(None, "BPE merges file (GPT2BPETokenizer).")
    tiktoken_pattern: str | None = arg(None, "TikTokenizer pre-tokenisation regex: v1, or v2 "
                                       "(Llama-3 style; used when unset).", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = arg(1000, "TikTokenizer: ids reserved for special "
                                           "tokens, before the BPE ranks.")
    tiktoken_special_tokens: list | None = arg(
        None, "TikTokenizer: special tokens, ids 0, 1, ...; must include <unk> <s> </s> "
        "(default: <unk> <s> </s> <mask> <pad> <cls> <sep>).", nargs="+")
    mmap_bin_files: bool = arg(
        True, "memory-mapping the .bin files (off: plain file reads).", action="store_false",
        flag="--no-mmap-bin-files",
        no_effect="the .bin is read with plain file reads instead of mmap; the samples are "
                  "the same")
    create_attention_mask_in_dataloader: bool = arg(
        True, "building the attention mask in the data loader.", action="store_false",
        flag="--no-create-attention-mask-in-dataloader",
        no_effect="megalite never builds a mask in the data loader; causal (and document) "
                  "masking happens in the attention kernel")
    num_workers: int = arg(0, "Data-loader worker processes.")
    reset_position_ids: bool = arg(False, "Restart position ids at each document.")
    reset_attention_mask: bool = arg(False, "Do not attend across documents.")
    eod_mask_loss: bool = arg(False, "Do not compute the loss on end-of-document tokens.")

    def __post_init__(self) -> None:
        check_choices(self)
        paths = {f"--{name.replace('_', '-')}": getattr(self, name) for name in
                 ("data_path", "train_data_path", "valid_data_path", "test_data_path")
                 if getattr(self, name)}
        if self.mock_data and paths:
            given = ", ".join(f"{flag} {' '.join(map(str, v))}" for flag, v in paths.items())
            flags = " / ".join(paths)
            raise ConfigError(f"--mock-data with {given}: mock data is synthetic and would "
                              f"never read {flags}; drop --mock-data to train on the data, or "
                              f"drop {flags} to train on mock data")
        require(self.num_workers >= 0, "num_workers must be >= 0")
        require(self.tiktoken_num_special_tokens >= 0,
                f"--tiktoken-num-special-tokens must be >= 0, got "
                f"{self.tiktoken_num_special_tokens}")
        parts = self.split.replace("/", ",").split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--split must be comma-separated numbers like 969,30,1, "
                              f"got {self.split!r}") from None
        require(all(v >= 0 for v in values) and sum(values) > 0 and len(values) <= 3,
                 f"--split must have up to 3 non-negative weights with a positive sum, "
                 f"got {self.split!r}")
