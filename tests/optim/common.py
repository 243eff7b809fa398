"""Helpers of the optimizer tests: one training run in this process's world, and what
to compare afterwards (layout-invariant full parameters, measured memory)."""

from __future__ import annotations

import torch

from megalite.data.tokenizers import build_tokenizer
from megalite.optim.memory import rank_memory
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components, default_datasets_provider
from megalite.pipeline.layout import model_chunks
from megalite.training.loop import train
from tests.training.common import tiny_config

LOSS_TOL = 1e-5     # a layout against one process: fp32 sums in another order
PARAM_TOL = 2e-5
BUCKET = 3000        # elements: ~10 buckets for the tiny GPT, parameters straddle shards
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"   # the last stage's copy of the tied embedding (pp > 1)
MTP_COPY = "mtp_embedding.word_embeddings.weight"   # V schedule: the depths' copy

VARIANTS = {
    "plain": {},
    "plain+overlap": {"overlap_grad_reduce": True},
    "distopt": {"use_distributed_optimizer": True},
    "distopt+overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                        "overlap_param_gather": True},
}


def config(world_size: int = 1, iters: int = 3, model=None, optim=None, **parallel):
    """The tiny GPT of tests/training (2 layers, hidden 32), micro-batch 2, global batch 8.
    ``model.vocab_size`` is the NullTokenizer's (61), as the default build would set it."""
    parallel.setdefault("ddp_bucket_size", BUCKET)
    cfg = tiny_config(world_size, parallel=parallel, model=model or {}, optim=optim or {},
                      train={"train_iters": iters, "micro_batch_size": 2,
                             "global_batch_size": 8})
    cfg.model.vocab_size = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size).vocab_size
    return cfg


class CachedDatasets:
    """A ``datasets_provider`` that builds the mock datasets once per process and key:
    building their indices costs more than training the tiny model."""

    def __init__(self):
        self.built: dict = {}

    def __call__(self, cfg, tokenizer):
        t = cfg.train
        key = (cfg.model.seq_length, cfg.model.vocab_size, t.seed, t.global_batch_size,
               t.train_iters, t.eval_iters, t.eval_interval)
        if key not in self.built:
            # config() already set the model's vocabulary to the tokenizer's (the NullTokenizer
            # adds one id, eod): build the same tokenizer, so eod stays inside the vocabulary
            tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size - 1)
            assert tok.vocab_size == cfg.model.vocab_size
            self.built[key] = default_datasets_provider(cfg, tok)
        return self.built[key]


DATASETS = CachedDatasets()


def full_params(model) -> dict:
    """name -> full (tp-gathered, collective over tp) parameter of every chunk; the last
    stage's tied output weight and (V schedule) the prediction depths' copy of the word
    embedding are reported under the embedding's name (an untied output layer under its
    own)."""
    out = {}
    for chunk in model_chunks(model):
        for name, tensor in chunk.full_state_dict().items():
            copy = (name == OUTPUT and chunk.tied) or name == MTP_COPY
            out[EMBEDDING if copy else name] = tensor
    return out


def assert_bitwise_same(got, want, iters: int, what: str) -> None:
    """Two runs' (losses, full parameters, optimizer state) are equal bit for bit: the
    same losses, every parameter, and every parameter's Adam moments and fp32 master."""
    (got_losses, got_params, got_state), (losses, params, state) = got, want
    assert got_losses == losses and len(losses) == iters, what
    assert set(got_params) == set(params), what
    for key, tensor in params.items():
        assert torch.equal(got_params[key], tensor), (what, key)
    assert got_state["step"] == state["step"] == iters, what
    for key, entry in state["params"].items():
        assert set(got_state["params"][key]) == set(entry) == \
            {"exp_avg", "exp_avg_sq", "master"}, (what, key)
        for field, tensor in entry.items():
            assert torch.equal(got_state["params"][key][field], tensor), (what, key, field)


def train_run(cfg, setup=None, inspect=None, ps=None):
    """Build, optionally ``setup(components)``, train; returns (TrainResult, full params,
    RankMemory, inspect(components) or None), with the groups still alive for the
    collectives of ``full_params`` / ``inspect``. ``ps``: reuse these groups (kept)."""
    own = ps is None
    ps = ParallelState.build(cfg.parallel) if own else ps
    c = build_components(cfg, ps, datasets_provider=DATASETS, peak_probe_seconds=0.01)
    try:
        if setup is not None:
            setup(c)
        result = train(c)
        c.grads.finish_param_sync()   # the documented wait before reading parameters
        params = full_params(c.model)
        memory = rank_memory(c.model, c.grads, c.optimizer)
        extra = inspect(c) if inspect is not None else None
    finally:
        c.close()
        if own:
            ps.destroy()
    return result, params, memory, extra


def assert_run_matches(losses: dict, params: dict, ref_losses: dict, ref_params: dict,
                       what: str) -> None:
    """One rank's losses (iteration -> loss) and parameters (name -> full tensor) against
    the single-process run's, within LOSS_TOL / PARAM_TOL."""
    assert list(losses) == list(ref_losses), what
    for it, want in ref_losses.items():
        assert abs(losses[it] - want) < LOSS_TOL, (what, it, losses[it], want)
    for name, tensor in params.items():
        torch.testing.assert_close(tensor, ref_params[name], rtol=0, atol=PARAM_TOL,
                                   msg=lambda m, n=name, w=what: f"{w} {n}: {m}")


# what a layout row's single-process reference leaves out: offload needs a sharded
# optimizer, and Muon's tp mode has nothing to split in one process
REFERENCE_DROPS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "muon_tp_mode")


def reference_key(layout) -> str:
    """The single-process run a layout row compares with: its model and optimizer
    settings, without :data:`REFERENCE_DROPS`."""
    optim = {k: v for k, v in layout.optim.items() if k not in REFERENCE_DROPS}
    return repr((layout.model, sorted(optim.items())))


def single_process_references(layouts) -> dict:
    """:func:`reference_key` -> (losses, full parameters) of each row's reference, trained
    once per key in this process (its loss must fall over the 3 iterations)."""
    refs = {}
    for layout in layouts:
        key = reference_key(layout)
        if key not in refs:
            optim = {k: v for k, v in layout.optim.items() if k not in REFERENCE_DROPS}
            result, params, _, _ = train_run(config(model=layout.model, optim=optim))
            assert result.losses[3] < result.losses[1]
            refs[key] = (result.losses, params)
    return refs


def assert_ranks_match(layout, ranks: list[tuple[dict, dict]], references: dict) -> None:
    """Every rank's (losses, full parameters) of ``layout`` against its single-process
    reference (:func:`single_process_references`); together the ranks hold every
    parameter."""
    ref_losses, ref_params = references[reference_key(layout)]
    names = set()
    for rank, (losses, params) in enumerate(ranks):
        assert_run_matches(losses, params, ref_losses, ref_params, f"{layout.name} rank {rank}")
        names.update(params)
    assert names == set(ref_params), layout.name

