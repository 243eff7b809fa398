"""Name tables: how a family's tensors map between megalite and Hugging Face.

Every family's table has the same three kinds of entries, applied to *full* (unsharded)
state dicts, as ``GPTModel.full_state_dict()`` gives them:

* :class:`Rename`: one megalite tensor is one ``transformers`` tensor, possibly transposed
  (GPT-2's ``Conv1D`` stores ``[in, out]``, our linears ``[out, in]``).
* :class:`Fuse`: one megalite tensor is several ``transformers`` tensors stacked along
  dim 0 (Llama's q/k/v in our ``linear_qkv``, gate/up in SwiGLU's ``linear_fc1``). The
  tensor-parallel sharding splits each part separately, so the full tensor is a plain
  concatenation of the parts.
* the output layer: ``lm_head.weight`` is our ``output_layer.weight``, or with tied
  embeddings a copy of the word embedding that is written but never read back.

Both directions keep only what the input holds, so a state dict with some layers (one
pipeline stage's) maps too; a fused tensor with some of its parts missing raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OUR_LAYER_PREFIX = "decoder.layers.{}."
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Rename:
    """``ours`` <-> ``hf``, the same tensor (``transpose``: ``[out, in]`` <-> ``[in, out]``)."""

    ours: str
    hf: str
    transpose: bool = False

    def convert(self, tensor: torch.Tensor) -> torch.Tensor:
        """Either direction: a transpose is its own inverse."""
        return tensor.t().contiguous() if self.transpose else tensor


@dataclass(frozen=True)
class Fuse:
    """``ours`` ``[sum(sizes), ...]`` <-> ``hf[k]`` ``[sizes[k], ...]``, stacked along dim 0."""

    ours: str
    hf: tuple[str, ...]
    sizes: tuple[int, ...]


def weight_and_bias(ours: str, hf: str, transpose: bool = False) -> tuple[Rename, Rename]:
    """Renames of module ``ours`` to ``hf``: its ``.weight`` (transposed if asked) and ``.bias``."""
    return (Rename(f"{ours}.weight", f"{hf}.weight", transpose),
            Rename(f"{ours}.bias", f"{hf}.bias"))


def fused_weight_and_bias(ours: str, hf: tuple[str, ...], sizes: tuple[int, ...]
                          ) -> tuple[Fuse, Fuse]:
    """Our fused module ``ours`` <-> the ``hf`` modules, weights and biases alike."""
    return (Fuse(f"{ours}.weight", tuple(f"{n}.weight" for n in hf), sizes),
            Fuse(f"{ours}.bias", tuple(f"{n}.bias" for n in hf), sizes))


@dataclass(frozen=True)
class NameTable:
    """A family's complete name mapping for one model configuration.

    ``globals``: embeddings and the final norm (the output layer is added from ``tied``);
    ``layer`` and ``fused``: per-layer suffixes under ``decoder.layers.{i}.`` on our side
    and ``hf_layer_prefix.format(i)`` on the Hugging Face side.
    """

    hf_layer_prefix: str
    globals: tuple[Rename, ...]
    layer: tuple[Rename, ...]
    fused: tuple[Fuse, ...] = ()
    tied: bool = False

    def _global_rules(self) -> tuple[Rename, ...]:
        return self.globals if self.tied else (*self.globals, Rename(OUTPUT_LAYER, LM_HEAD))

    def to_hf(self, state: dict[str, torch.Tensor], num_layers: int
              ) -> dict[str, torch.Tensor]:
        out = {r.hf: r.convert(state[r.ours]) for r in self._global_rules() if r.ours in state}
        if self.tied and WORD_EMBEDDINGS in state:
            out[LM_HEAD] = state[WORD_EMBEDDINGS]
        for i in range(num_layers):
            ours_p, hf_p = OUR_LAYER_PREFIX.format(i), self.hf_layer_prefix.format(i)
            for r in self.layer:
                if ours_p + r.ours in state:
                    out[hf_p + r.hf] = r.convert(state[ours_p + r.ours])
            for f in self.fused:
                if ours_p + f.ours in state:
                    for hf, part in zip(f.hf, state[ours_p + f.ours].split(f.sizes)):
                        out[hf_p + hf] = part.contiguous()
        return out

    def from_hf(self, hf_state: dict[str, torch.Tensor], num_layers: int
                ) -> dict[str, torch.Tensor]:
        out = {r.ours: r.convert(hf_state[r.hf]) for r in self._global_rules()
               if r.hf in hf_state}
        for i in range(num_layers):
            ours_p, hf_p = OUR_LAYER_PREFIX.format(i), self.hf_layer_prefix.format(i)
            for r in self.layer:
                if hf_p + r.hf in hf_state:
                    out[ours_p + r.ours] = r.convert(hf_state[hf_p + r.hf])
            for f in self.fused:
                present = [hf_p + n in hf_state for n in f.hf]
                if not any(present):
                    continue
                missing = [hf_p + n for n, p in zip(f.hf, present) if not p]
                if missing:
                    raise KeyError(f"incomplete fused tensor {f.ours}: missing {missing}")
                out[ours_p + f.ours] = torch.cat([hf_state[hf_p + n] for n in f.hf])
        return out
