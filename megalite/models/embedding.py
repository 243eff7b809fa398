"""Token (+ learned absolute position) embeddings of a GPT model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.layers.embedding import VocabParallelEmbedding
from megalite.parallel.params import mark_param
from megalite.parallel.random import REPLICATED, TENSOR_PARALLEL


class GPTEmbedding(torch.nn.Module):
    """ids ``[s, b]`` and positions ``[s, b]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` under
    sequence parallelism), followed by dropout.

    The word table is vocabulary-parallel over ``ps.tp``; the position table
    ``[max_positions, h]`` (``learned_absolute`` only, and not with
    ``--no-position-embedding``, which leaves no positions at all) is replicated. Under
    sequence parallelism the word embedding is reduce-scattered along the sequence and each
    rank adds the positions of its own chunk, so the position table's gradient is partial
    (it is marked ``sequence_parallel``).
    """

    def __init__(self, cfg, padded_vocab_size: int, ps, *, sequence_parallel: bool,
                 rng, device=None, dtype=None):
        super().__init__()
        self.tp_group = ps.tp
        device = ps.device if device is None else device
        self.sequence_parallel = sequence_parallel
        self.rng = rng
        self.dropout = cfg.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, cfg.hidden_size, vocab_size=cfg.vocab_size, ps=ps,
            sequence_parallel=sequence_parallel, init_std=cfg.init_method_std,
            device=device, dtype=dtype)
        self.position_embeddings = None
        if cfg.learned_positions:
            self.position_embeddings = torch.nn.Embedding(
                cfg.max_position_embeddings, cfg.hidden_size, device=device, dtype=dtype)
            mark_param(self.position_embeddings.weight, init_std=cfg.init_method_std,
                       sequence_parallel=sequence_parallel)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            if self.sequence_parallel:
                position_ids = position_ids.chunk(self.tp_group.size, dim=0)[self.tp_group.rank]
            x = x + self.position_embeddings(position_ids)
        if self.training and self.dropout > 0.0:
            stream = TENSOR_PARALLEL if self.sequence_parallel else REPLICATED
            with self.rng.fork(stream):
                x = F.dropout(x, self.dropout)
        return x

