"""Routed-expert tensors in Hugging Face's gate/up/down naming (Qwen3-MoE, DeepSeek-V3),
both ways with megalite's stacked experts.

megalite stacks a layer's E experts: ``experts.fc1`` ``[E, h, 2f]`` (gate then up along the
last dim) and ``experts.fc2`` ``[E, f, h]``. Hugging Face has two spellings: transformers'
in-memory fused tensors ``mlp.experts.gate_up_proj`` ``[E, 2f, h]`` / ``down_proj``
``[E, h, f]``, and the hub files' per-expert ``mlp.experts.{j}.gate_proj / up_proj /
down_proj.weight`` (``[f, h]``, ``[f, h]``, ``[h, f]``)."""

from __future__ import annotations

import torch


def experts_to_hf(state: dict[str, torch.Tensor], ours_mlp: str, hf_mlp: str
                  ) -> dict[str, torch.Tensor]:
    """One layer's stacked experts as transformers' fused ``{hf_mlp}experts.gate_up_proj``
    ``[E, 2f, h]`` / ``down_proj`` ``[E, h, f]``; empty where ``state`` holds no experts
    under ``ours_mlp`` (a dense layer, or another stage's)."""
    if ours_mlp + "experts.fc1" not in state:
        return {}
    return {hf_mlp + "experts.gate_up_proj": state[ours_mlp + "experts.fc1"].transpose(1, 2),
            hf_mlp + "experts.down_proj": state[ours_mlp + "experts.fc2"].transpose(1, 2)}


def experts_from_hf(hf_state: dict[str, torch.Tensor], hf_mlp: str, ours_mlp: str,
                    num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's ``{ours_mlp}experts.fc1 / fc2`` from either spelling under the HF
    prefix ``hf_mlp`` (``model.layers.N.mlp.``); empty when the layer holds neither."""
    if hf_mlp + "experts.gate_up_proj" in hf_state:
        return {ours_mlp + "experts.fc1": hf_state[hf_mlp + "experts.gate_up_proj"].transpose(1, 2),
                ours_mlp + "experts.fc2": hf_state[hf_mlp + "experts.down_proj"].transpose(1, 2)}
    if hf_mlp + "experts.0.gate_proj.weight" not in hf_state:
        return {}

    def w(j: int, name: str) -> torch.Tensor:
        return hf_state[f"{hf_mlp}experts.{j}.{name}.weight"]

    experts = range(num_experts)
    return {ours_mlp + "experts.fc1": torch.stack(
                [torch.cat([w(j, "gate_proj").t(), w(j, "up_proj").t()], dim=1)
                 for j in experts]),
            ours_mlp + "experts.fc2": torch.stack([w(j, "down_proj").t() for j in experts])}


def experts_to_hub_names(hf_state: dict[str, torch.Tensor], ffn: int
                         ) -> dict[str, torch.Tensor]:
    """``hf_state`` with each fused ``mlp.experts.gate_up_proj`` / ``down_proj`` split into
    the hub files' per-expert tensors (``ffn``: the expert hidden size f); other tensors as
    they are."""
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for j, w in enumerate(tensor):            # [2f, h] = [gate; up]
                out[f"{stem}{j}.gate_proj.weight"] = w[:ffn].contiguous()
                out[f"{stem}{j}.up_proj.weight"] = w[ffn:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            stem = name.removesuffix("down_proj")
            for j, w in enumerate(tensor):            # [h, f]
                out[f"{stem}{j}.down_proj.weight"] = w.contiguous()
        else:
            out[name] = tensor
    return out
