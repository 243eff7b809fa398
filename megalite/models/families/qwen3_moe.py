"""Qwen3-MoE: Qwen3's attention (query/key norms, GQA, no biases) and fine-grained
experts (``Qwen3MoeForCausalLM``), some layers optionally dense.

Per MoE layer, every tensor ``[E, ...]`` holds every global expert, as
``GPTModel.full_state_dict()`` gives them (the same stacking as Mixtral's):

========================  ==================================  ==================================
megalite                  transformers (v5, in memory)        hub files
========================  ==================================  ==================================
``mlp.router.weight``     ``mlp.gate.weight`` ``[E, h]``      ``mlp.gate.weight``
``mlp.experts.fc1``       ``mlp.experts.gate_up_proj``        ``mlp.experts.{j}.gate_proj`` and
``[E, h, 2f]`` gate|up    ``[E, 2f, h]``, transposed          ``up_proj`` ``[f, h]``
``mlp.experts.fc2``       ``mlp.experts.down_proj``           ``mlp.experts.{j}.down_proj``
``[E, f, h]``             ``[E, h, f]``, transposed           ``[h, f]``
========================  ==================================  ==================================

Dense layers are Llama's MLP (``mlp.gate_proj`` / ``up_proj`` / ``down_proj``) of
``intermediate_size`` (our ``--ffn-hidden-size``); experts have ``moe_intermediate_size``
(``--moe-ffn-hidden-size``).

Which layers are sparse: Hugging Face's layer ``i`` has experts when ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``. That becomes a
``--moe-layer-freq`` list expression (``"[0]*1+[1]*3"``; ``1`` when every layer is
sparse); the export writes ``decoder_sparse_step=1`` and the dense layers as
``mlp_only_layers``.

Routing: softmax over all E, top-k; ``norm_topk_prob=True`` renormalizes the k weights,
which is megalite's ``--moe-router-score-function softmax`` (softmax over the top-k
logits), and ``norm_topk_prob=False`` keeps them, which is ``--moe-router-pre-softmax``.
No top-k scaling factor, groups, expert bias or shared experts.
"""

from __future__ import annotations

import torch

from megalite.models.families.experts import (
    experts_from_hf,
    experts_to_hf,
    experts_to_hub_names,
)
from megalite.models.families.llama import HF_LAYER_PREFIX
from megalite.models.families.names import OUR_LAYER_PREFIX
from megalite.models.families.qwen3 import Qwen3Spec


def layer_freq_expression(pattern) -> int | str:
    """``--moe-layer-freq`` for a per-layer MoE pattern: ``1`` when every layer is MoE,
    else a list expression of runs (``(False, True, True)`` -> ``"[0]*1+[1]*2"``)."""
    pattern = [bool(p) for p in pattern]
    if all(pattern):
        return 1
    runs: list[list[int]] = []
    for p in pattern:
        if runs and runs[-1][0] == int(p):
            runs[-1][1] += 1
        else:
            runs.append([int(p), 1])
    return "+".join(f"[{v}]*{n}" for v, n in runs)


def hf_moe_pattern(hf_cfg) -> list[bool]:
    """Which layers of a ``Qwen3MoeConfig`` have experts (transformers' rule)."""
    dense = set(getattr(hf_cfg, "mlp_only_layers", None) or [])
    step = getattr(hf_cfg, "decoder_sparse_step", 1) or 1
    return [i not in dense and hf_cfg.num_experts > 0 and (i + 1) % step == 0
            for i in range(hf_cfg.num_hidden_layers)]


class Qwen3MoeSpec(Qwen3Spec):
    name = "qwen3_moe"
    hf_model_type = "qwen3_moe"
    hf_architecture = "Qwen3MoeForCausalLM"
    defaults = {**Qwen3Spec.defaults, "num_experts": 8, "moe_router_topk": 2,
                "moe_router_score_function": "softmax",
                "moe_router_load_balancing_type": "aux_loss"}
    rope_theta_default = 10000.0

    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        return [text for bad, text in [
            (c.num_experts is None, "--num-experts is not set"),
            (c.num_experts is not None and not any(c.moe_layer_pattern),
             f"--moe-layer-freq {c.moe_layer_freq} makes no layer MoE"),
            (bool(c.moe_shared_expert_intermediate_size), "shared experts"),
            (c.moe_router_score_function != "softmax",
             f"--moe-router-score-function {c.moe_router_score_function}"),
            (c.moe_router_topk_scaling_factor not in (None, 1.0), "a top-k scaling factor"),
            (c.moe_router_num_groups is not None, "group-limited routing"),
            (c.moe_router_enable_expert_bias, "a router expert bias"),
            (c.add_bias_linear or c.add_qkv_bias, "linear biases"),
        ] if bad] + self.backbone_problems(c)

    # -- tensors -------------------------------------------------------------------------
    def to_hf(self, state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
        out = super().to_hf(state, model_cfg)  # embeddings, attention, norms, dense MLPs
        for i in range(model_cfg.num_layers):
            ours, hf = OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i) + "mlp."
            if ours + "router.weight" not in state:  # a dense layer, or another stage's
                continue
            out[hf + "gate.weight"] = state[ours + "router.weight"]
            out.update(experts_to_hf(state, ours, hf))
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        out = super().from_hf(hf_state, model_cfg)
        for i in range(model_cfg.num_layers):
            ours, hf = OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i) + "mlp."
            if hf + "gate.weight" not in hf_state:  # a dense layer, or another stage's
                continue
            out[ours + "router.weight"] = hf_state[hf + "gate.weight"]
            out.update(experts_from_hf(hf_state, hf, ours, model_cfg.num_experts))
        return {k: v.contiguous() for k, v in out.items()}

    def to_hub_names(self, hf_state: dict[str, torch.Tensor], model_cfg
                     ) -> dict[str, torch.Tensor]:
        """Fused expert tensors -> the per-expert tensors the hub files hold."""
        return experts_to_hub_names(hf_state, model_cfg.moe_ffn_hidden_size)

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import Qwen3MoeConfig

        self.check(model_cfg)
        c = model_cfg
        dense = [i for i, moe in enumerate(c.moe_layer_pattern) if not moe]
        hf_cfg = Qwen3MoeConfig(**self.backbone_hf_kwargs(c), intermediate_size=c.ffn_hidden_size,
                                moe_intermediate_size=c.moe_ffn_hidden_size,
                                num_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                                norm_topk_prob=not c.moe_router_pre_softmax,
                                decoder_sparse_step=1, mlp_only_layers=dense,
                                router_aux_loss_coef=c.moe_aux_loss_coeff,
                                attention_bias=False, use_sliding_window=False)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def config_from_hf(self, hf_cfg) -> dict:
        """``ValueError`` for rope scaling, ``attention_bias``, a sliding window and a
        model without MoE layers (a dense Qwen3 is ``model_type`` qwen3)."""
        kwargs = self.qwen3_from_hf(hf_cfg)
        pattern = hf_moe_pattern(hf_cfg)
        if not any(pattern):
            raise ValueError("no layer has experts (num_experts, decoder_sparse_step, "
                             "mlp_only_layers); convert it as a dense qwen3 model")
        return {**kwargs, "num_experts": hf_cfg.num_experts,
                "moe_router_topk": hf_cfg.num_experts_per_tok,
                "moe_ffn_hidden_size": hf_cfg.moe_intermediate_size,
                "moe_layer_freq": layer_freq_expression(pattern),
                "moe_router_pre_softmax": not hf_cfg.norm_topk_prob,
                "moe_aux_loss_coeff": float(hf_cfg.router_aux_loss_coef)}


SPEC = Qwen3MoeSpec()
