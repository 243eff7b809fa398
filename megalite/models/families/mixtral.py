"""Mixtral: Llama's embeddings, attention and norms, and a sparse MoE block in every layer
(``MixtralForCausalLM``).

Per layer, every tensor ``[E, ...]`` holds every global expert, as
``GPTModel.full_state_dict()`` gives them:

========================  ==================================  ===========================
megalite                  transformers (v5, in memory)        hub files (``w1/w2/w3``)
========================  ==================================  ===========================
``mlp.router.weight``     ``mlp.gate.weight`` ``[E, h]``      ``block_sparse_moe.gate``
``mlp.experts.fc1``       ``mlp.experts.gate_up_proj``        ``fc1[j] = [w1_j.T | w3_j.T]``
``[E, h, 2f]`` gate|up    ``[E, 2f, h]``, transposed
``mlp.experts.fc2``       ``mlp.experts.down_proj``           ``fc2[j] = w2_j.T``
``[E, f, h]``             ``[E, h, f]``, transposed
========================  ==================================  ===========================

:meth:`MixtralSpec.from_hf` reads either naming; :meth:`MixtralSpec.to_hf` writes the
in-memory one (``MixtralForCausalLM.load_state_dict``) and
:meth:`MixtralSpec.to_hub_names` the files' one (what ``save_pretrained`` writes). The
router matches Mixtral's with ``--moe-router-score-function softmax`` (top-k of the
logits, softmax over the k: the same as softmax over all E, top-k, renormalize) and no
top-k scaling factor.
"""

from __future__ import annotations

import torch

from megalite.models.families.llama import HF_LAYER_PREFIX, LlamaSpec
from megalite.models.families.names import OUR_LAYER_PREFIX

HUB_MOE = "block_sparse_moe."


def _moe_prefixes(i: int) -> tuple[str, str]:
    """(our MoE block, HF layer) name prefixes of layer ``i``."""
    return OUR_LAYER_PREFIX.format(i) + "mlp.", HF_LAYER_PREFIX.format(i)


class MixtralSpec(LlamaSpec):
    name = "mixtral"
    hf_model_type = "mixtral"
    hf_architecture = "MixtralForCausalLM"
    defaults = {**LlamaSpec.defaults, "num_experts": 8, "moe_router_topk": 2,
                "moe_router_score_function": "softmax",
                "moe_router_load_balancing_type": "aux_loss"}
    rope_theta_default = 1000000.0

    def problems(self, model_cfg) -> list[str]:
        c = model_cfg
        return [text for bad, text in [
            (c.num_experts is None, "--num-experts is not set"),
            (c.num_experts is not None and not all(c.moe_layer_pattern),
             f"--moe-layer-freq {c.moe_layer_freq} (Mixtral: every layer)"),
            (bool(c.moe_shared_expert_intermediate_size), "shared experts"),
            (c.moe_router_score_function != "softmax",
             f"--moe-router-score-function {c.moe_router_score_function}"),
            (c.moe_router_topk_scaling_factor not in (None, 1.0), "a top-k scaling factor"),
            (c.moe_router_pre_softmax, "--moe-router-pre-softmax"),
            (c.moe_router_num_groups is not None, "group-limited routing"),
            (c.moe_router_enable_expert_bias, "a router expert bias"),
            (c.add_bias_linear or c.add_qkv_bias, "linear biases"),
        ] if bad] + self.backbone_problems(c)

    # -- tensors -------------------------------------------------------------------------
    def to_hf(self, state: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
        out = super().to_hf(state, model_cfg)  # embeddings, attention, norms
        for i in range(model_cfg.num_layers):
            ours, hf = _moe_prefixes(i)
            if ours + "router.weight" not in state:  # e.g. another pipeline stage's layer
                continue
            out[hf + "mlp.gate.weight"] = state[ours + "router.weight"]
            out[hf + "mlp.experts.gate_up_proj"] = state[ours + "experts.fc1"].transpose(1, 2)
            out[hf + "mlp.experts.down_proj"] = state[ours + "experts.fc2"].transpose(1, 2)
        return {k: v.contiguous() for k, v in out.items()}

    def from_hf(self, hf_state: dict[str, torch.Tensor], model_cfg
                ) -> dict[str, torch.Tensor]:
        out = super().from_hf(hf_state, model_cfg)
        for i in range(model_cfg.num_layers):
            ours, hf = _moe_prefixes(i)
            if hf + "mlp.gate.weight" in hf_state:  # transformers v5 in-memory names
                moe = hf + "mlp."
                out[ours + "router.weight"] = hf_state[moe + "gate.weight"]
                out[ours + "experts.fc1"] = hf_state[moe + "experts.gate_up_proj"].transpose(1, 2)
                out[ours + "experts.fc2"] = hf_state[moe + "experts.down_proj"].transpose(1, 2)
            elif hf + HUB_MOE + "gate.weight" in hf_state:  # hub checkpoint files
                moe = hf + HUB_MOE

                def w(j: int, name: str, moe=moe) -> torch.Tensor:
                    return hf_state[f"{moe}experts.{j}.{name}.weight"]

                experts = range(model_cfg.num_experts)
                out[ours + "router.weight"] = hf_state[moe + "gate.weight"]
                out[ours + "experts.fc1"] = torch.stack(
                    [torch.cat([w(j, "w1").t(), w(j, "w3").t()], dim=1) for j in experts])
                out[ours + "experts.fc2"] = torch.stack([w(j, "w2").t() for j in experts])
        return {k: v.contiguous() for k, v in out.items()}

    def to_hub_names(self, hf_state: dict[str, torch.Tensor], model_cfg
                     ) -> dict[str, torch.Tensor]:
        """Fused ``mlp.experts.gate_up_proj`` / ``down_proj`` and ``mlp.gate`` -> the
        per-expert ``block_sparse_moe.experts.{j}.w1/w2/w3`` and ``block_sparse_moe.gate``."""
        out, f = {}, model_cfg.moe_ffn_hidden_size
        for name, tensor in hf_state.items():
            prefix, sep, rest = name.partition(".mlp.")
            moe = f"{prefix}.{HUB_MOE}"
            if not sep:
                out[name] = tensor
            elif rest == "gate.weight":
                out[moe + "gate.weight"] = tensor
            elif rest == "experts.gate_up_proj":
                for j, w in enumerate(tensor):            # [2f, h] = [w1; w3]
                    out[f"{moe}experts.{j}.w1.weight"] = w[:f].contiguous()
                    out[f"{moe}experts.{j}.w3.weight"] = w[f:].contiguous()
            elif rest == "experts.down_proj":
                for j, w in enumerate(tensor):            # [h, f]
                    out[f"{moe}experts.{j}.w2.weight"] = w.contiguous()
            else:
                out[name] = tensor
        return out

    # -- configs -------------------------------------------------------------------------
    def hf_config(self, model_cfg, token_ids: tuple[int, int] | None = None):
        from transformers import MixtralConfig

        self.check(model_cfg)
        c = model_cfg
        hf_cfg = MixtralConfig(**self.backbone_hf_kwargs(c),
                               intermediate_size=c.moe_ffn_hidden_size, sliding_window=None,
                               num_local_experts=c.num_experts,
                               num_experts_per_tok=c.moe_router_topk,
                               router_aux_loss_coef=c.moe_aux_loss_coeff)
        return self.with_token_ids(hf_cfg, c, token_ids)

    def config_from_hf(self, hf_cfg) -> dict:
        """``ValueError`` for rope scaling and sliding-window attention."""
        kwargs = self.backbone_from_hf(hf_cfg)
        window = hf_cfg.sliding_window
        if window is not None and window < kwargs["seq_length"]:
            raise ValueError(f"sliding-window attention ({window}) is not supported")
        return {**kwargs, "num_experts": hf_cfg.num_local_experts,
                "moe_router_topk": hf_cfg.num_experts_per_tok,
                "moe_ffn_hidden_size": hf_cfg.intermediate_size,
                "moe_aux_loss_coeff": float(hf_cfg.router_aux_loss_coef)}


SPEC = MixtralSpec()
