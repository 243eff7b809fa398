"""Learning-rate schedules: warm-up, constant / linear / cosine / WSD / inverse-sqrt decay."""

import math

import pytest

from megalite.config import ConfigError, OptimConfig
from megalite.optim.lr_schedule import LRScheduler


def sched(**kw) -> LRScheduler:
    base = {"max_lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "decay_steps": 110}
    base.update(kw)
    return LRScheduler(**base)


def test_linear_warmup_then_linear_decay():
    s = sched(decay_style="linear")
    assert s.lr_at(0) == 0.0
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.55)         # halfway: min + 0.5 * (max - min)
    assert s.lr_at(110) == pytest.approx(0.1)
    assert s.lr_at(500) == pytest.approx(0.1)          # past the decay: min_lr


def test_cosine():
    s = sched(decay_style="cosine")
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.55)
    r = 0.25
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * r)))
    assert s.lr_at(110) == pytest.approx(0.1)


def test_constant_ignores_min_lr():
    s = sched(decay_style="constant")
    assert s.lr_at(3) == pytest.approx(0.3)
    assert [s.lr_at(k) for k in (10, 100, 1000)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("style,mid", [("linear", 0.55), ("cosine", 0.55),
                                        ("exponential", 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1))])
def test_wsd_stable_then_cooldown(style, mid):
    s = sched(decay_style="WSD", wsd_decay_style=style, wsd_decay_steps=20)
    assert s.lr_at(10) == 1.0 and s.lr_at(90) == 1.0   # stable until decay - wsd
    assert s.lr_at(100) == pytest.approx(mid)
    assert s.lr_at(110) == pytest.approx(0.1)
    assert s.lr_at(111) == pytest.approx(0.1)


def test_inverse_square_root():
    s = sched(decay_style="inverse-square-root")
    assert s.lr_at(40) == pytest.approx(math.sqrt(10 / 40))
    assert s.lr_at(10_000) == pytest.approx(0.1)


def test_from_config_defaults_and_warmup_fraction():
    s = LRScheduler.from_config(OptimConfig(lr=2.0, min_lr=0.0, lr_warmup_fraction=0.1,
                                            lr_decay_style="linear"), train_iters=200)
    assert (s.warmup_steps, s.decay_steps) == (20, 200)
    assert s.lr_at(10) == pytest.approx(1.0)
    s = LRScheduler.from_config(OptimConfig(lr=2.0, lr_decay_iters=50, lr_warmup_iters=5),
                                train_iters=200)
    assert (s.warmup_steps, s.decay_steps) == (5, 50)


def test_step_apply_and_state_round_trip():
    import torch

    s = sched(decay_style="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)
    for _ in range(7):
        s.step()
    assert s.apply(opt) == pytest.approx(0.7) and opt.param_groups[0]["lr"] == pytest.approx(0.7)
    other = sched(decay_style="linear")
    other.load_state_dict(s.state_dict())
    assert other.num_steps == 7 and other.lr == s.lr


def test_bad_configurations_are_named():
    with pytest.raises(ConfigError, match="WSD needs --lr-wsd-decay-iters"):
        sched(decay_style="WSD")
    with pytest.raises(ConfigError, match="must not be fewer than the warm-up"):
        sched(decay_style="cosine", warmup_steps=200)
    with pytest.raises(ConfigError, match="--lr-decay-iters or --train-iters"):
        LRScheduler.from_config(OptimConfig(), train_iters=None)


def test_lr_warmup_init_starts_the_warmup_there():
    """Megatron's --lr-warmup-init: lr(k) = init + (max - init) * k / warmup during the
    warm-up (in samples too, and for the decoupled groups with their own peak); the decay
    after it is unchanged. Values from the DeepSeek-V3 script (3.9e-7 up to 3.9e-6)."""
    ocfg = OptimConfig(lr=3.9e-6, min_lr=3.9e-7, lr_warmup_init=3.9e-7, lr_warmup_iters=8,
                       lr_decay_iters=40, lr_decay_style="cosine", decoupled_lr=1e-5)
    s = LRScheduler.from_config(ocfg, train_iters=40)
    plain = LRScheduler.from_config(OptimConfig(lr=3.9e-6, min_lr=3.9e-7, lr_warmup_iters=8,
                                                lr_decay_iters=40, lr_decay_style="cosine"),
                                    train_iters=40)
    for k in range(9):
        assert s.lr_at(k) == pytest.approx(3.9e-7 + (3.9e-6 - 3.9e-7) * k / 8, rel=1e-12)
        assert s.lr_at(k, decoupled=True) == pytest.approx(3.9e-7 + (1e-5 - 3.9e-7) * k / 8)
    assert s.lr_at(0) != plain.lr_at(0) == 0.0
    for k in (9, 20, 40, 60):
        assert s.lr_at(k) == pytest.approx(plain.lr_at(k), rel=1e-12)
    in_samples = LRScheduler.from_config(ocfg, train_iters=40, global_batch_size=4)
    assert in_samples.lr_at(16) == pytest.approx(3.9e-7 + (3.9e-6 - 3.9e-7) * 16 / 32)
    with pytest.raises(ConfigError, match="--lr-warmup-init must be >= 0"):
        OptimConfig(lr_warmup_init=-1.0)
