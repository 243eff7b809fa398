"""``--decoupled-lr`` / ``--decoupled-min-lr``: the input word embedding and the output
layer (only them) follow the LR schedule with their own peak and minimum; one process,
pipeline parallelism (tied embedding copied on the last stage) and the distributed
optimizer."""

import math

import pytest
import torch

from megalite.config import ConfigError
from megalite.optim.lr_schedule import LRScheduler
from megalite.optim.optimizer import param_groups
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config

EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"
LR, MIN_LR, DLR, DMIN = 3e-3, 3e-4, 1e-2, 1e-3
ITERS = 4


def _cosine(step, top, bottom, warmup=1, decay=ITERS):
    """Hand computation of the schedule used by update ``step`` (0-based)."""
    if step <= warmup:
        return top * step / warmup
    ratio = (step - warmup) / (decay - warmup)
    return bottom + (top - bottom) * 0.5 * (math.cos(math.pi * ratio) + 1)


def test_param_groups_split_only_embedding_and_output():
    t = torch.zeros
    named = [(EMB, t(4, 2)), ("embedding.position_embeddings.weight", t(4, 2)),
             ("decoder.layers.0.mlp.linear_fc1.weight", t(2, 2)),
             ("decoder.layers.0.mlp.linear_fc1.bias", t(2)), (OUT, t(4, 2))]
    groups = param_groups(named, 0.1, decoupled_lr=True)
    summary = [(g["names"], g["weight_decay"], g.get("decoupled_lr", False)) for g in groups]
    assert summary == [
        (["embedding.position_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"],
         0.1, False),
        (["decoder.layers.0.mlp.linear_fc1.bias"], 0.0, False),
        ([EMB, OUT], 0.1, True)]
    # without the flag: the two usual groups, unmarked
    assert [g["names"] for g in param_groups(named, 0.1)] == [
        [EMB, "embedding.position_embeddings.weight",
         "decoder.layers.0.mlp.linear_fc1.weight", OUT],
        ["decoder.layers.0.mlp.linear_fc1.bias"]]


def test_scheduler_decoupled_curve_and_default_min():
    sched = LRScheduler(max_lr=LR, min_lr=MIN_LR, warmup_steps=1, decay_steps=ITERS,
                        decay_style="cosine", decoupled_max_lr=DLR, decoupled_min_lr=DMIN)
    for k in range(ITERS + 2):
        assert sched.lr_at(k) == pytest.approx(_cosine(k, LR, MIN_LR) if k <= ITERS
                                               else MIN_LR, rel=1e-12)
        assert sched.lr_at(k, decoupled=True) == pytest.approx(
            _cosine(k, DLR, DMIN) if k <= ITERS else DMIN, rel=1e-12)
    cfg = tiny_config(optim={"decoupled_lr": DLR})
    assert LRScheduler.from_config(cfg.optim, 8).decoupled_min_lr == cfg.optim.min_lr
    with pytest.raises(ConfigError, match="--decoupled-min-lr needs --decoupled-lr"):
        tiny_config(optim={"decoupled_min_lr": DMIN})


def _groups_after_training(world_size, parallel, model=None):
    cfg = tiny_config(world_size, parallel=parallel,
                      model={"position_embedding_type": "learned_absolute", **(model or {})},
                      train={"train_iters": ITERS},
                      optim={"lr": LR, "min_lr": MIN_LR, "decoupled_lr": DLR,
                             "decoupled_min_lr": DMIN, "lr_warmup_iters": 1,
                             "lr_decay_style": "cosine"})
    _, c = run_training(cfg)
    names = [n for g in c.optimizer.param_groups for n in g["names"]]
    groups = [(sorted(set(g["names"])), g["lr"], g.get("decoupled_lr", False))
              for g in c.optimizer.param_groups]
    return groups, names


def _check(groups, all_names):
    # the last update (number ITERS - 1) ran at these rates
    want_main, want_dec = _cosine(ITERS - 1, LR, MIN_LR), _cosine(ITERS - 1, DLR, DMIN)
    decoupled = set()
    for names, lr, is_dec in groups:
        if is_dec:
            assert set(names) <= {EMB, OUT}
            decoupled |= set(names)
            assert lr == pytest.approx(want_dec, rel=1e-12)
        else:
            assert not set(names) & {EMB, OUT}
            assert lr == pytest.approx(want_main, rel=1e-12)
    assert decoupled == set(all_names) & {EMB, OUT}
    assert "embedding.position_embeddings.weight" not in decoupled
    return decoupled


def test_one_process_only_embedding_and_output_get_the_decoupled_lr():
    groups, names = _groups_after_training(1, {})
    assert _check(groups, names) == {EMB}  # tied: one word embedding, no output weight
    groups, names = _groups_after_training(
        1, {}, model={"untie_embeddings_and_output_weights": True})
    assert _check(groups, names) == {EMB, OUT}


def _body(rank, world_size, parallel):
    groups, names = _groups_after_training(world_size, parallel)
    return sorted(_check(groups, names))


def test_pipeline_stages_both_decouple_their_copy_of_the_tied_embedding():
    # stage 0 holds the word embedding, stage 1 the tied copy as output_layer.weight
    assert run_distributed(2, _body, {"pipeline_model_parallel_size": 2}) == [[EMB], [OUT]]


def test_distributed_optimizer_shards_keep_the_decoupled_lr():
    # shards may split the embedding: each rank's pieces of it are decoupled, nothing else
    parallel = {"use_distributed_optimizer": True, "ddp_bucket_size": 3000}
    per_rank = run_distributed(2, _body, parallel)
    assert set().union(*map(set, per_rank)) == {EMB}
