"""The two loss normalisations against a hand computation with uneven loss masks.

Global batch: 8 samples in 4 micro-batches of 2 (one process, or dp=2 with 2 each). The
gradient of one step must be that of

- default / ``--calculate-per-token-loss``: ``sum_i l_i m_i / sum_i m_i`` over the batch;
- ``--per-microbatch-loss`` (Megatron's default): ``1/4 sum_mb (sum l m / sum m)_mb``.

The reported ``lm_loss`` is the global token mean in both.
"""

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.training.build import build_components, default_model_provider
from megalite.training.loop import train_step
from tests.distributed.harness import run_distributed
from tests.training.common import tiny_config

SEQ, VOCAB = 16, 64
# valid tokens per sample: micro-batches (pairs) hold 16+16, 2+1, 9+16, 4+0 tokens
VALID = [16, 16, 2, 1, 9, 16, 4, 0]


class UnevenMaskDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        text = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        mask = torch.zeros(SEQ)
        mask[:VALID[i % 8]] = 1.0
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": mask,
                "position_ids": torch.arange(SEQ)}


def _datasets(cfg, tokenizer):
    return UnevenMaskDataset(), None, None


def _samples(indices):
    items = [UnevenMaskDataset()[i] for i in indices]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def _reference(ref, mode):
    """Hand computation: the objective of ``mode`` on samples 0..7, its gradients."""
    per_token, masks = [], []
    for mb in range(4):
        batch = _samples([2 * mb, 2 * mb + 1])
        per_token.append(ref(batch["tokens"], position_ids=batch["position_ids"],
                             labels=batch["labels"]).float())
        masks.append(batch["loss_mask"])
    sums = [(lo * m).sum() for lo, m in zip(per_token, masks)]
    total = sum(m.sum() for m in masks)
    if mode == "global":
        objective = sum(sums) / total
    else:
        objective = sum(s / m.sum().clamp_min(1.0) for s, m in zip(sums, masks)) / 4
    objective.backward()
    global_mean = float(sum(s.detach() for s in sums) / total)
    return {n: p.grad.clone() for n, p in ref.named_parameters()}, global_mean


def _step_grads(world_size, mode):
    train = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 1,
             "calculate_per_token_loss": mode == "per-token-flag",
             "per_microbatch_loss": mode == "per-microbatch"}
    cfg = tiny_config(world_size, train=train, model={"vocab_size": VOCAB},
                      optim={"clip_grad": 0.0})
    ps = ParallelState.build(cfg.parallel)
    c = build_components(cfg, ps, datasets_provider=_datasets, peak_probe_seconds=0.01)
    try:
        ref = default_model_provider(c.cfg, ps)
        ref.load_state_dict(c.model.state_dict())
        it = c.train_iterator(0)
        step = train_step(c, [next(it) for _ in range(c.num_microbatches)], 1)
        grads = {n: p.main_grad.clone() for n, p in c.model.named_parameters()}
        want, global_mean = _reference(ref, "per-microbatch" if mode == "per-microbatch"
                                       else "global")
    finally:
        c.close()
        ps.destroy()
    return step.lm_loss, global_mean, grads, want


def _check(lm_loss, global_mean, grads, want):
    assert lm_loss == pytest.approx(global_mean, rel=1e-6)
    assert set(grads) == set(want)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-4, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["default", "per-token-flag", "per-microbatch"])
def test_one_process_matches_hand_computation(mode):
    _check(*_step_grads(1, mode))


def test_the_two_modes_differ_with_uneven_masks():
    _, _, global_grads, _ = _step_grads(1, "default")
    _, _, per_mb_grads, _ = _step_grads(1, "per-microbatch")
    name = "embedding.word_embeddings.weight"
    assert not torch.allclose(global_grads[name], per_mb_grads[name], rtol=1e-2)


def _dp2_body(rank, world_size, mode):
    lm_loss, global_mean, grads, want = _step_grads(world_size, mode)
    _check(lm_loss, global_mean, grads, want)
    return lm_loss


@pytest.mark.parametrize("mode", ["default", "per-microbatch"])
def test_dp2_matches_hand_computation(mode):
    losses = run_distributed(2, _dp2_body, mode)
    assert losses[0] == losses[1]


def test_flags_conflict():
    from megalite.config import ConfigError

    with pytest.raises(ConfigError, match="--calculate-per-token-loss and "
                                          "--per-microbatch-loss"):
        tiny_config(train={"calculate_per_token_loss": True, "per_microbatch_loss": True})
