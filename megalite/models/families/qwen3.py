"""Qwen3 (dense): Llama's RoPE, RMSNorm, SwiGLU and grouped-query attention with a
per-head RMSNorm on queries and keys before RoPE (``--qk-layernorm``), no biases, tied or
untied embeddings (``Qwen3ForCausalLM``).

Names are Llama's (:mod:`megalite.models.families.llama`) plus the two query/key norms,
one ``[d]`` weight each, shared by the heads:

=======================================  ===============================
megalite (``decoder.layers.{i}.``)       transformers (``model.layers.{i}.``)
=======================================  ===============================
``self_attention.q_layernorm.weight``    ``self_attn.q_norm.weight``
``self_attention.k_layernorm.weight``    ``self_attn.k_norm.weight``
=======================================  ===============================

Sliding-window attention (``use_sliding_window``) and ``attention_bias`` are refused.
"""

from __future__ import annotations

import dataclasses

from megalite.models.families.llama import LlamaSpec
from megalite.models.families.names import NameTable, Rename

QK_NORMS = (Rename("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            Rename("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"))


def sliding_window_problem(hf_cfg, seq_length: int) -> str | None:
    """Why a Qwen3 config's sliding window cannot be converted (``None``: it is off, or
    no narrower than the sequence)."""
    window = getattr(hf_cfg, "sliding_window", None)
    if getattr(hf_cfg, "use_sliding_window", False) and window is not None \
            and window < seq_length:
        return f"sliding-window attention ({window}) is not supported"
    return None


class Qwen3Spec(LlamaSpec):
    name = "qwen3"
    hf_model_type = "qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    defaults = {**LlamaSpec.defaults, "qk_layernorm": True}

    def backbone_problems(self, model_cfg) -> list[str]:
        """Llama's backbone, with the query/key norms required instead of refused."""
        # the "--qk-layernorm" entry is Llama's refusal of the norms Qwen3 needs
        found = [p for p in super().backbone_problems(model_cfg)
                 if not p.startswith("--qk-layernorm")]
        if not model_cfg.qk_layernorm:
            found.append("no --qk-layernorm (Qwen3 normalizes queries and keys)")
        return found

    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        return self.backbone_problems(c) + [text for bad, text in [
            (c.num_experts is not None, "experts (--num-experts)"),
            (c.add_bias_linear or c.add_qkv_bias, "linear biases"),
        ] if bad]

    def name_table(self, model_cfg) -> NameTable:
        table = super().name_table(model_cfg)
        return dataclasses.replace(table, layer=(*table.layer, *QK_NORMS))

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import Qwen3Config

        self.check(model_cfg)
        c = model_cfg
        hf_cfg = Qwen3Config(**self.backbone_hf_kwargs(c), intermediate_size=c.ffn_hidden_size,
                             attention_bias=False, use_sliding_window=False)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def qwen3_from_hf(self, hf_cfg) -> dict:
        """``ModelConfig`` kwargs of what Qwen3 and Qwen3-MoE share; ``ValueError`` for
        rope scaling, ``attention_bias`` and a sliding window."""
        kwargs = self.backbone_from_hf(hf_cfg)
        if getattr(hf_cfg, "attention_bias", False):
            raise ValueError("attention_bias (q/k/v and o_proj biases) has no megalite "
                             "equivalent without MLP biases")
        problem = sliding_window_problem(hf_cfg, kwargs["seq_length"])
        if problem:
            raise ValueError(problem)
        return {**kwargs, "qk_layernorm": True, "add_bias_linear": False,
                "add_qkv_bias": False}

    def config_from_hf(self, hf_cfg) -> dict:
        return self.qwen3_from_hf(hf_cfg)


SPEC = Qwen3Spec()
