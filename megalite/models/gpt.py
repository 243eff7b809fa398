"""GPTModel: a decoder-only transformer, GPT-2, Llama or Mixtral by configuration.

* GPT-2:   LayerNorm, GeLU, learned absolute positions, biases, tied embeddings.
* Llama:   RMSNorm, SwiGLU, RoPE (rotate-half layout), grouped-query attention, no biases,
           untied output layer.
* Mixtral: Llama with ``--num-experts E --moe-router-topk k``: every layer's MLP (every
           ``--moe-layer-freq``-th) is a mixture of SwiGLU experts
           (:class:`megalite.moe.layer.MoELayer`, expert parallel over ``ps.ep``).

Tensor parallelism follows Megatron-LM (column/row-parallel projections, vocabulary-parallel
embedding, output layer and cross entropy), optionally with sequence parallelism.
Internally activations are ``[s, b, h]``; the public interface is batch-first.
Parameters are initialized from (seed, parameter name) and sliced for this TP rank, so every
layout builds the same model (``layers.sharding``); names use global layer numbers
(``decoder.layers.<i>.``), so a pipeline stage holding layers 4..7 matches too. Expert
weights are drawn per global expert, so the model is also the same whatever the
expert-parallel layout. Every parameter is drawn once (``layers.sharding.initialize_params``).
"""

from __future__ import annotations

import torch

from megalite.config.run import DEFAULT_SEED
from megalite.layers.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from megalite.layers.cross_entropy import vocab_parallel_cross_entropy
from megalite.layers.linear import ColumnParallelLinear
from megalite.layers.sharding import gather_full, initialize_params, shard
from megalite.models.embedding import GPTEmbedding
from megalite.moe.experts import gather_expert_full, shard_expert_full
from megalite.parallel.params import param_meta, update_meta
from megalite.parallel.random import RNGTracker
from megalite.transformer.block import TransformerBlock
from megalite.transformer.mtp import MultiTokenPrediction, mtp_depths
from megalite.transformer.rope import RotaryEmbedding
from megalite.transformer.yarn import YarnRotaryEmbedding

EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


class GPTModel(torch.nn.Module):
    """See the module docstring. Arguments:

    model_cfg:  ``ModelConfig`` with ``vocab_size`` set; the vocabulary is padded to
                ``model_cfg.padded_vocab_size(tp)``.
    ps:         the ``ParallelState``; every layer picks its groups from it (``tp``;
                MoE layers also ``ep`` / ``etp`` / ``tp_cp``) and ``ps.device``.
    seed:       init and dropout seed.
    pre_process / post_process: this pipeline stage holds the embedding / the output layer.
    first_layer, num_layers: the global layer range of this stage (default: all layers).
    rng:        the dropout RNG tracker to draw from; the model chunks of one pipeline rank
                share one (default: a new tracker seeded from ``seed`` and the pp rank).
    """

    def __init__(self, model_cfg, ps, sequence_parallel: bool = False, seed: int = DEFAULT_SEED,
                 pre_process: bool = True, post_process: bool = True, first_layer: int = 0,
                 num_layers: int | None = None, rng: RNGTracker | None = None):
        super().__init__()
        cfg = self.config = model_cfg
        if cfg.vocab_size is None:
            raise ValueError("model_cfg.vocab_size must be set before building GPTModel")
        cfg.check_layout(ps.tp.size, ps.cp.size, ps.ep.size, ps.etp.size)
        self.ps = ps
        tp = self.tp_group = ps.tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab_size = cfg.padded_vocab_size(tp.size)
        self.rng = rng if rng is not None else RNGTracker.from_state(ps, seed)
        self.tied = not cfg.untie_embeddings_and_output_weights
        kw = {"device": ps.device, "dtype": cfg.params_dtype}
        common = dict(sequence_parallel=self.sequence_parallel, **kw)

        # multi-token prediction on the last stage (megalite.transformer.mtp); a later
        # stage holding it keeps a copy of the word embedding, as Megatron-Core's does.
        # Under a V schedule the output chunk is chunk 1 of the first pipeline rank, whose
        # chunk 0 holds the embedding: the copy is named ``mtp_embedding`` there (the
        # optimizer and the checkpoint key a rank's parameters by name) and is an
        # ``embedding_copy`` (not saved, not in the gradient norm, its gradient summed with
        # the embedding's on this rank, ``optim.data_parallel``)
        self.mtp = None
        if post_process and mtp_depths(cfg):
            self.mtp = MultiTokenPrediction(cfg, ps, rng=self.rng, seed=seed, **common)
        self.embedding = self.mtp_embedding = None
        if pre_process or self.mtp is not None:
            embedding = GPTEmbedding(cfg, self.padded_vocab_size, ps, rng=self.rng, **common)
            if pre_process or not ps.v_shape:
                self.embedding = embedding
            else:
                self.mtp_embedding = embedding
                update_meta(embedding.word_embeddings.weight, init_name=EMBEDDING_WEIGHT,
                            shared_embedding=True, embedding_copy=True)
        self.rotary = None
        if cfg.multi_latent_attention:   # its own RoPE part, with YaRN's scaling
            self.rotary = YarnRotaryEmbedding(cfg, device=ps.device)
        elif cfg.position_embedding_type == "rope":
            self.rotary = RotaryEmbedding(cfg.kv_channels, cfg.rotary_percent, cfg.rotary_base,
                                          device=ps.device)
        self.decoder = TransformerBlock(cfg, ps, rng=self.rng, first_layer=first_layer,
                                        num_layers=num_layers, post_process=post_process,
                                        seed=seed, **common)
        self.output_layer = None
        if post_process:
            share = self.tied and self.word_embedding() is not None
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size, self.padded_vocab_size, bias=False, gather_output=False,
                init_std=cfg.init_method_std, skip_weight_param=share, reuse_buffers=True,
                ps=ps, **common)
            if not share:
                update_meta(self.output_layer.weight, unpadded_size=cfg.vocab_size)
                if self.tied:  # a later pipeline stage's copy of the word embedding
                    update_meta(self.output_layer.weight, init_name=EMBEDDING_WEIGHT,
                                shared_embedding=True, embedding_copy=True)
        # the word embedding lives on the first and the last stage: tied to the output
        # layer, or looked up again by the prediction depths (summed over ps.embedding)
        if self.embedding is not None and (
                self.tied or (mtp_depths(cfg) and ps.pp.size > 1)):
            update_meta(self.embedding.word_embeddings.weight, shared_embedding=True)
        initialize_params(self, seed, ps)

    # -- forward -------------------------------------------------------------------------
    def word_embedding(self) -> GPTEmbedding | None:
        """The embedding this chunk looks tokens up in: its own, or (V schedule, output
        chunk with prediction depths) the copy ``mtp_embedding``; None on a middle chunk."""
        return self.embedding if self.embedding is not None else self.mtp_embedding

    def output_weight(self) -> torch.Tensor:
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.word_embedding().word_embeddings.weight

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                inference_cache=None, mtp_tokens: torch.Tensor | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids, labels: int64 ``[b, s]``.

        ``inference_cache`` (generation only, without sequence or context parallelism;
        a pipeline stage caches its own layers, :mod:`megalite.inference.stages`): an
        :class:`~megalite.inference.kv_cache.InferenceCache`; the tokens are the ones
        after its ``seq_len`` cached ones (positions default to ``seq_len ..``), their
        keys/values are cached, and ``seq_len`` advances.

        ``document_ids`` int64 ``[b, s_full]`` (``--reset-attention-mask``; the whole
        sequence even under context parallelism): each token attends only within its
        document.

        ``hidden_states`` ``[s, b, h]`` (``[s/tp, b, h]`` under SP) replaces ``input_ids``
        on a stage without the embedding. Returns: hidden states ``[s(/tp), b, h]`` when
        not ``post_process``; else with ``labels`` the per-token loss fp32 ``[b, s]``,
        without them this rank's logits ``[b, s, padded_vocab/tp]`` in the compute dtype.
        ``--cross-entropy-loss-fusion`` computes the loss in chunks of tokens
        (``layers.chunked_cross_entropy``).

        ``mtp_tokens`` / ``mtp_labels`` int64 ``[N, b, s]`` (the rolled batch entries of
        :func:`megalite.transformer.mtp.roll_for_mtp`, with ``labels``, on the stage with
        the prediction depths): their per-token losses fp32 ``[b, s]``, one per depth, are
        left in ``self.mtp_losses`` (None otherwise) for the caller to weigh and mask.
        """
        self.mtp_losses = None
        if inference_cache is not None and position_ids is None:
            start = inference_cache.seq_len
            given = input_ids if input_ids is not None else hidden_states.transpose(0, 1)
            b, s = given.shape[:2]
            position_ids = torch.arange(start, start + s, device=given.device).expand(b, s)
        pos = None if position_ids is None else position_ids.t()
        if self.pre_process:
            x = self.embedding(input_ids.t(), pos)  # [s(/tp), b, h]
        else:
            x = hidden_states
        rotary = None
        if self.rotary is not None:
            if pos is None:
                seq = x.shape[0] * (self.tp_group.size if self.sequence_parallel else 1)
                pos = torch.arange(seq, device=x.device).unsqueeze(1)
            rotary = self.rotary(pos)
        if inference_cache is None:
            x = self.decoder(x, rotary, document_ids)
        else:
            if self.sequence_parallel or self.ps.cp.size > 1:
                raise NotImplementedError("KV-cache inference runs without sequence or "
                                          "context parallelism")
            x = self.decoder(x, rotary, document_ids, inference_cache=inference_cache)
            inference_cache.advance(x.shape[0])
        if not self.post_process:
            return x
        if labels is not None and mtp_tokens is not None and self.mtp is not None:
            def embed(ids):   # [b, s] -> [s(/tp), b, h], at the unshifted positions
                return self.word_embedding()(ids.t(), pos)

            def head(h, k):
                return self._loss(self.output_layer(h, weight=self.output_weight()),
                                  mtp_labels[k])
            self.mtp_losses = self.mtp(x, mtp_tokens, embed, head, rotary, document_ids)
        logits = self.output_layer(x, weight=self.output_weight())  # [s, b, V/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self._loss(logits, labels)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss fp32 ``[b, s]`` of ``logits`` ``[s, b, V/tp]``, ``labels`` ``[b, s]``."""
        cross_entropy = (chunked_vocab_parallel_cross_entropy
                         if self.config.cross_entropy_loss_fusion
                         else vocab_parallel_cross_entropy)
        loss = cross_entropy(logits, labels.t(), self.tp_group,
                             vocab_size=self.config.vocab_size)
        return loss.t().contiguous()

    # -- full (layout-invariant) tensors -------------------------------------------------
    def _gather(self, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if param_meta(param).expert:  # all experts: over etp, then ep
            return gather_expert_full(local, param, self.ps)
        return gather_full(local, param, self.tp_group)

    def _shard(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if param_meta(param).expert:
            return shard_expert_full(full, param, self.ps)
        return shard(full, param, self.tp_group.size, self.tp_group.rank)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """name -> full tensor, gathered over tp (collective), padding rows removed; expert
        weights ``[E, ...]`` with every expert (collective over etp and ep); persistent
        buffers (a router's ``expert_bias``, replicated) as they are."""
        out = {name: self._gather(p.detach(), p) for name, p in self.named_parameters()}
        out.update({name: b.detach().clone() for name, b in self._state_buffers().items()})
        return out

    def _state_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers by name (replicated, not trained)."""
        params = dict(self.named_parameters())
        return {name: t for name, t in self.state_dict(keep_vars=True).items()
                if name not in params and not isinstance(t, torch.nn.Parameter)}

    @torch.no_grad()
    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """name -> full gradient (collective over tp; etp and ep for experts). Call
        ``allreduce_sequence_parallel_grads`` first under sequence parallelism."""
        return {name: self._gather(p.grad, p)
                for name, p in self.named_parameters() if p.grad is not None}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy full tensors (as from :meth:`full_state_dict`) into this rank's shards."""
        params = dict(self.named_parameters())
        buffers = self._state_buffers()
        missing = set(params) - set(state)
        unexpected = set(state) - set(params) - set(buffers)
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
        for name, b in buffers.items():   # absent (a converted model): left as built
            if name in state:
                b.copy_(state[name].to(b.dtype))
        for name, p in params.items():
            local = self._shard(state[name].to(torch.float32), p)
            if local.shape != p.shape:
                raise ValueError(f"{name}: full tensor {tuple(state[name].shape)} gives shard "
                                 f"{tuple(local.shape)}, expected {tuple(p.shape)}")
            p.copy_(local)
