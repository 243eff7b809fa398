"""What a model family is: :class:`FamilySpec`, the base class of every family's spec.

A spec answers, for one Hugging Face architecture: which ``ModelConfig`` settings make the
family (``defaults``), whether a given model belongs to it (``problems`` / ``matches``),
how the tensors are named (``name_table``), and how the two configs translate
(``hf_config`` / ``config_from_hf``). State dicts are *full* (unsharded), as from
``GPTModel.full_state_dict()``; ``GPTModel.load_full_state_dict`` shards them.

Zero-centred norms (``--apply-layernorm-1p``) store ``w`` where Hugging Face stores
``1 + w``: :meth:`FamilySpec.to_hf` adds the one and :meth:`FamilySpec.from_hf` subtracts
it, in the tensor's dtype. For Hugging Face weights in [0.5, 2] (any trained norm's
neighbourhood of one) ``w - 1`` is exact in floating point, so HF -> megalite -> HF gives
back the same bits; elsewhere the round trip is exact to one rounding of ``w - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megalite.models.families.names import NameTable

NORM_WEIGHT_SUFFIX = "layernorm.weight"  # input_, pre_mlp_ and final_layernorm.weight


def shift_norm_weights(state: dict[str, torch.Tensor], delta: float
                       ) -> dict[str, torch.Tensor]:
    """``state`` with ``delta`` added to every norm weight (our names), other tensors as is."""
    return {k: v + delta if k.endswith(NORM_WEIGHT_SUFFIX) else v for k, v in state.items()}


def attention_variant_problems(model_cfg) -> list[str]:
    """The attention variants no built-in family's Hugging Face class has (their norms and
    latent projections would be dropped by a conversion)."""
    return [text for bad, text in [
        (model_cfg.multi_latent_attention, "multi-latent attention (DeepSeek)"),
        (model_cfg.qk_layernorm and not model_cfg.multi_latent_attention,
         "--qk-layernorm (query/key norms)"),
    ] if bad]


def trained_token_ids(tokenizer) -> tuple[int, int]:
    """(bos, eos) ids of the tokenizer a model was trained with, as a Hugging Face config
    writes them: eos is the end-of-document id training appended (``tokenizer.eod``); bos
    is the tokenizer's own begin-of-text id where it has one (SentencePiece, Llama-2,
    TikToken), else also the end-of-document id (GPT-2's convention: ``<|endoftext|>`` is
    both)."""
    eod = int(tokenizer.eod)
    bos = getattr(tokenizer, "bos", None)
    return (int(bos) if isinstance(bos, int) and 0 <= bos < tokenizer.vocab_size else eod,
            eod)


class FamilySpec:
    """One model family. Subclasses set the class attributes and implement ``problems``,
    ``name_table``, ``hf_config`` and ``config_from_hf``; the rest has working defaults.
    """

    name: str                     # megalite's name for it: "llama"
    hf_model_type: str            # transformers' ``config.model_type``: "llama"
    hf_architecture: str          # transformers' class, in config.json: "LlamaForCausalLM"
    defaults: Mapping[str, Any]   # ModelConfig fields that make the family (sizes aside)
    # Hugging Face tensors with no megalite counterpart that a conversion may drop
    # (buffers some checkpoints store, e.g. GPT-2's causal mask ``.attn.bias``)
    ignored_hf_suffixes: tuple[str, ...] = ()
    # Hugging Face tensors an export keeps in fp32 whatever ``--dtype`` (as the hub's
    # checkpoints store them, e.g. DeepSeek-V3's router correction bias)
    fp32_hf_suffixes: tuple[str, ...] = ()

    # -- which models --------------------------------------------------------------------
    def problems(self, model_cfg) -> list[str]:
        """What keeps ``model_cfg`` from being a model of this family (empty: nothing)."""
        raise NotImplementedError

    def matches(self, model_cfg) -> bool:
        return not self.problems(model_cfg)

    def check(self, model_cfg) -> None:
        """Raise ``ValueError`` naming every problem unless ``model_cfg`` fits the family."""
        found = self.problems(model_cfg)
        if found:
            raise ValueError(f"not a {self.name} model: {'; '.join(found)}")

    # -- tensors -------------------------------------------------------------------------
    def name_table(self, model_cfg) -> NameTable:
        raise NotImplementedError

    def to_hf(self, state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
        """Our full state dict -> the ``hf_architecture`` class's state dict (its
        ``load_state_dict`` names); 1p norm weights ``w`` become ``1 + w``."""
        self.check(model_cfg)
        if model_cfg.apply_layernorm_1p:
            state = shift_norm_weights(state, 1.0)
        return self.name_table(model_cfg).to_hf(state, model_cfg.num_layers)

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict -> our full state dict. Tensors our configuration does
        not use (e.g. biases under --disable-bias-linear) must be absent from ``hf_state``.
        With ``--apply-layernorm-1p`` norm weights ``w`` become ``w - 1``."""
        self.check(model_cfg)
        state = self.name_table(model_cfg).from_hf(hf_state, model_cfg.num_layers)
        return shift_norm_weights(state, -1.0) if model_cfg.apply_layernorm_1p else state

    def to_hub_names(self, hf_state: dict[str, torch.Tensor], model_cfg
                     ) -> dict[str, torch.Tensor]:
        """:meth:`to_hf`'s in-memory names -> the names ``save_pretrained`` writes to
        checkpoint files, where they differ (Mixtral's experts); :meth:`from_hf` reads
        both."""
        return hf_state

    def dropped_hf_tensors(self, hf_state: dict[str, torch.Tensor], model_cfg
                           ) -> tuple[list[str], str]:
        """(names in a Hugging Face checkpoint that a conversion drops on purpose, why: one
        line for the converter's note); nothing by default. DeepSeek-V3's multi-token
        prediction layers, which transformers does not load either, are such tensors."""
        return [], ""

    def fit_to_weights(self, model_cfg, hf_state: dict[str, torch.Tensor]):
        """(``model_cfg`` as the checkpoint's tensors allow, a note or ""): what config.json
        promises but the weights lack is left out (DeepSeek-V3's MTP modules, which
        transformers' ``save_pretrained`` never writes); unchanged by default."""
        return model_cfg, ""

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        """A ``transformers`` config equivalent to ``model_cfg`` (imported lazily), with
        ``token_ids`` as its (bos, eos) ids (:meth:`with_token_ids`)."""
        raise NotImplementedError

    @staticmethod
    def with_token_ids(hf_cfg, model_cfg, token_ids: tuple[int, int] | None = None):
        """``hf_cfg`` with its ``bos_token_id`` / ``eos_token_id``: ``token_ids`` (bos,
        eos), the ids the model was trained with (:func:`trained_token_ids`); without them
        the architecture's defaults where they are ids of this vocabulary, else unset
        (GPT-2's 50256 in an 8000-token model is no token at all)."""
        if token_ids is not None:
            hf_cfg.bos_token_id, hf_cfg.eos_token_id = (int(i) for i in token_ids)
            return hf_cfg
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(hf_cfg, name, None)
            if isinstance(value, int) and not 0 <= value < model_cfg.vocab_size:
                setattr(hf_cfg, name, None)
        return hf_cfg

    def config_from_hf(self, hf_cfg) -> dict[str, Any]:
        """``ModelConfig`` keyword arguments for a ``transformers`` config. Raises
        ``ValueError`` for what megalite cannot represent."""
        raise NotImplementedError

    def conversion_warnings(self, hf_cfg) -> list[str]:
        """Differences :meth:`config_from_hf` accepts but that change the logits slightly."""
        return []

    def export_warnings(self, model_cfg) -> list[str]:
        """Differences :meth:`hf_config` cannot carry that change the logits slightly, and
        what an export leaves out: multi-token prediction depths (``--mtp-num-layers``),
        which only DeepSeek-V3's format holds (its spec writes them)."""
        n = model_cfg.mtp_num_layers or 0
        return [f"the {n} multi-token prediction depth(s) (--mtp-num-layers) are not "
                f"written: {self.hf_architecture} has no place for them (the logits are "
                f"unaffected)"] if n else []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
