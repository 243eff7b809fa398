"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers N``).

``N`` extra prediction depths run on the last pipeline stage (the last virtual chunk)
after the decoder. Depth ``k`` (1..N) predicts, at position ``i``, the token ``i + k + 1``:

    e_k = enorm(embedding(tokens rolled left by k))       [s, b, h]
    x_k = eh_proj(cat[e_k, hnorm(h_{k-1})])                [s, b, 2h] -> [s, b, h]
    h_k = final_layernorm(transformer_layer(x_k))
    loss_k = cross_entropy(output_layer(h_k), labels rolled left by k)

``h_0`` is the decoder's output after its final norm (what Megatron-Core's GPTModel hands
its MTP block); ``embedding`` and ``output_layer`` are the main model's (shared weights:
on a later pipeline stage a copy of the word embedding whose gradient is summed with the
first stage's over ``ps.embedding``; under a V schedule the output chunk sits on the first
stage beside the embedding, and its copy ``mtp_embedding`` is summed there,
``models.gpt``). The transformer layer is of the kind of the
decoder's last layer (dense or MoE MLP, MLA or standard attention), as Megatron-Core builds
it from the last layer's spec. Rolled tokens past the end are 0 and their labels are
masked (:func:`roll_for_mtp`, applied to the whole sequence before a context-parallel
split, so every cp rank's chunks hold the same shifted tokens a single process sees).

The training objective is ``lm_loss + (mtp_loss_scaling_factor / N) * sum_k loss_k``, each
``loss_k`` summed over its rolled loss mask and divided by the same token count as the LM
loss (``megalite.training.forward_backward``).

Tensor parallelism: ``eh_proj`` is column-parallel over ``ps.tp`` (weight ``[h/tp, 2h]``);
its output ``[s, b, h/tp]`` is gathered over ``ps.tp`` to ``[s, b, h]`` and, under sequence
parallelism, scattered back to this rank's ``[s/tp, b, h]`` (its input was gathered along
the sequence by the linear). Parameter names ``mtp.layers.<k-1>.{enorm, hnorm, eh_proj,
transformer_layer, final_layernorm}`` are Megatron-Core's and do not depend on the layout.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megalite.layers.linear import ColumnParallelLinear
from megalite.parallel import mappings
from megalite.transformer.layer import TransformerLayer
from megalite.transformer.norms import build_norm

# batch entries ([N, b, s]) made by roll_for_mtp
MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask")


def mtp_depths(cfg) -> int:
    """How many prediction depths ``cfg`` (a ModelConfig) asks for (0: none)."""
    return cfg.mtp_num_layers or 0


def roll_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` ``[b, s]`` shifted left by ``k`` along the sequence: ``out[:, i] = x[:, i + k]``,
    the last ``k`` positions 0."""
    out = torch.zeros_like(x)
    if k < x.shape[-1]:
        out[..., :x.shape[-1] - k] = x[..., k:]
    return out


@torch.no_grad()
def roll_for_mtp(batch: dict, depths: int) -> dict:
    """``batch`` with ``mtp_tokens``, ``mtp_labels``, ``mtp_loss_mask`` ``[N, b, s]``: the
    whole sequence's tokens, labels and loss mask rolled left by 1..N (a no-op for N = 0).
    Call before the context-parallel split (which cuts their last dim)."""
    if not depths:
        return batch
    out = dict(batch)
    for key, name in zip(("tokens", "labels", "loss_mask"), MTP_KEYS):
        out[name] = torch.stack([roll_left(batch[key], k) for k in range(1, depths + 1)])
    return out


class MTPDepth(torch.nn.Module):
    """One prediction depth (Megatron-Core's MultiTokenPredictionLayer); see the module
    docstring. ``depth`` is 1-based; its transformer layer has the global number
    ``num_layers + depth - 1`` (its MoE router's seed, the expert bias table's row) and
    copies the kind of layer ``num_layers - 1``."""

    def __init__(self, cfg, depth: int, ps, *, sequence_parallel: bool, rng, seed: int,
                 device=None, dtype=None):
        super().__init__()
        self.tp_group = ps.tp
        self.sequence_parallel = sequence_parallel
        self.rng = rng
        self.recompute = cfg.recompute_granularity == "full"
        kw = {"sequence_parallel": sequence_parallel, "device": device, "dtype": dtype}
        norm = dict(zero_centered=cfg.apply_layernorm_1p, **kw)
        h = cfg.hidden_size
        self.enorm = build_norm(cfg.normalization, h, cfg.norm_epsilon, **norm)
        self.hnorm = build_norm(cfg.normalization, h, cfg.norm_epsilon, **norm)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, gather_output=True,
                                            init_std=cfg.init_method_std, ps=ps, **kw)
        self.transformer_layer = TransformerLayer(
            cfg, cfg.num_layers + depth - 1, ps, rng=rng, seed=seed,
            spec_layer=cfg.num_layers - 1, **kw)
        self.final_layernorm = build_norm(cfg.normalization, h, cfg.norm_epsilon, **norm)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, rotary=None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``embedded`` (the rolled tokens' embedding) and ``hidden`` (the previous depth's
        output): ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same."""
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = self.eh_proj(x)                        # [s, b, h], gathered over ps.tp
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.tp_group)
        layer = self.transformer_layer
        if self.recompute and self.training and torch.is_grad_enabled():
            x = checkpoint(layer, x, rotary, document_ids, use_reentrant=False,
                           context_fn=self.rng.recompute_context_fn)
        else:
            x = layer(x, rotary, document_ids)
        return self.final_layernorm(x)


class MultiTokenPrediction(torch.nn.Module):
    """The ``N`` depths (``layers.0 .. layers.N-1``), run one after the other."""

    def __init__(self, cfg, ps, *, sequence_parallel: bool, rng, seed: int, device=None,
                 dtype=None):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MTPDepth(cfg, k, ps, sequence_parallel=sequence_parallel, rng=rng, seed=seed,
                     device=device, dtype=dtype)
            for k in range(1, mtp_depths(cfg) + 1))

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embed, head, rotary=None,
                document_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``hidden``: the decoder's output ``[s(/tp), b, h]``; ``tokens`` ``[N, b, s]`` (the
        rolled ids, this cp rank's positions); ``embed(ids [b, s]) -> [s(/tp), b, h]`` and
        ``head(h_k, k - 1) -> per-token result`` are the shared embedding and output layer.
        Returns ``head(h_k)`` for k = 1..N."""
        out = []
        for k, depth in enumerate(self.layers):
            hidden = depth(embed(tokens[k]), hidden, rotary, document_ids)
            out.append(head(hidden, k))
        return out
