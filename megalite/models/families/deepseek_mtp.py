"""DeepSeek-V3's multi-token prediction tensors <-> megalite's ``mtp.layers.{j}.``.

Hub checkpoints keep ``num_nextn_predict_layers`` MTP modules as the layer indices after
the model's, ``model.layers.{L + j}.`` (``L = num_hidden_layers``); transformers never
loads them. Depth ``j`` (0-based) maps as

====================================  ===================================================
megalite ``mtp.layers.{j}.``          transformers ``model.layers.{L + j}.``
====================================  ===================================================
``enorm.weight`` / ``hnorm.weight``   ``enorm.weight`` / ``hnorm.weight``
``eh_proj.weight`` ``[h, 2h]``        ``eh_proj.weight`` (both concatenate [embedding,
                                      hidden] in that order)
``transformer_layer.*``               the decoder layer's names (``self_attn.*``,
                                      ``mlp.*``, norms), as for layer ``L + j``
``final_layernorm.weight``            ``shared_head.norm.weight``
(the shared word embedding)           ``embed_tokens.weight``
(the shared output layer)             ``shared_head.head.weight``
====================================  ===================================================

megalite's depths use the main model's embedding and output layer, so an import requires
each depth's ``embed_tokens`` / ``shared_head.head`` (where present) to equal
``model.embed_tokens`` / ``lm_head`` and refuses the checkpoint otherwise; an export
writes them as copies of the main ones, as the hub files hold them.
"""

from __future__ import annotations

import torch

from megalite.models.families.experts import experts_from_hf, experts_to_hf
from megalite.models.families.names import (
    LM_HEAD,
    OUR_LAYER_PREFIX,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
)

OURS = "mtp.layers.{}."
HF = "model.layers.{}."
HF_EMBED = "model.embed_tokens.weight"
OWN = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
       ("eh_proj.weight", "eh_proj.weight"),
       ("final_layernorm.weight", "shared_head.norm.weight"))
LAYER = "transformer_layer."


def mtp_to_hf(state: dict[str, torch.Tensor], model_cfg, table) -> dict[str, torch.Tensor]:
    """The depths of our full ``state`` as the hub's tensors (``table``: the family's
    NameTable, whose layer names the depths' layers use)."""
    L, out = model_cfg.num_layers, {}
    head = state.get(OUTPUT_LAYER, state.get(WORD_EMBEDDINGS))
    for j in range(model_cfg.mtp_num_layers or 0):
        ours, hf = OURS.format(j), HF.format(L + j)
        if ours + "eh_proj.weight" not in state:
            continue   # another pipeline stage's piece
        out.update({hf + h: state[ours + o] for o, h in OWN})
        as_decoder = OUR_LAYER_PREFIX.format(L + j)
        layer = {as_decoder + k[len(ours + LAYER):]: v for k, v in state.items()
                 if k.startswith(ours + LAYER)}
        out.update(table.to_hf(layer, L + j + 1))
        out.update(experts_to_hf(layer, as_decoder + "mlp.", hf + "mlp."))
        # copies (safetensors refuses two names for one storage)
        if WORD_EMBEDDINGS in state:
            out[hf + "embed_tokens.weight"] = state[WORD_EMBEDDINGS].clone()
        if head is not None:
            out[hf + "shared_head.head.weight"] = head.clone()
    return out


def mtp_from_hf(hf_state: dict[str, torch.Tensor], model_cfg, table
                ) -> dict[str, torch.Tensor]:
    """Our ``mtp.layers.{j}.`` tensors from the hub's; ``ValueError`` where a depth's own
    embedding or head differs from the main model's (module docstring)."""
    L, out = model_cfg.num_layers, {}
    main_head = hf_state.get(LM_HEAD, hf_state.get(HF_EMBED))
    for j in range(model_cfg.mtp_num_layers or 0):
        ours, hf = OURS.format(j), HF.format(L + j)
        missing = [hf + h for _, h in OWN if hf + h not in hf_state]
        if missing:
            raise KeyError(f"multi-token prediction depth {j + 1}: missing {missing}")
        for name, main in (("embed_tokens.weight", hf_state.get(HF_EMBED)),
                           ("shared_head.head.weight", main_head)):
            own = hf_state.get(hf + name)
            if own is not None and (main is None or not torch.equal(own, main)):
                raise ValueError(f"{hf}{name} differs from the main model's: megalite's "
                                 "multi-token prediction shares the embedding and the "
                                 "output layer")
        out.update({ours + o: hf_state[hf + h] for o, h in OWN})
        layer = {k: v for k, v in hf_state.items() if k.startswith(hf)}
        as_decoder = OUR_LAYER_PREFIX.format(L + j)
        mapped = table.from_hf(layer, L + j + 1)
        mapped.update(experts_from_hf(layer, hf + "mlp.", as_decoder + "mlp.",
                                      model_cfg.num_experts))
        out.update({ours + LAYER + k[len(as_decoder):]: v for k, v in mapped.items()
                    if k.startswith(as_decoder)})
    return out
