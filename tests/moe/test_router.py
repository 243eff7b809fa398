"""Router math: scores, top-k, capacity and drops, aux / seq-aux / z losses, injection."""

import math

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.moe.router import (
    AttachAuxLoss,
    TopKRouter,
    apply_capacity,
    expert_capacity,
    scores_for_aux_loss,
    topk_probs,
)
from megalite.parallel.state import ParallelState


def _state():
    return ParallelState.build(ParallelConfig())


def _router(**kw):
    cfg = ModelConfig(hidden_size=8, num_experts=kw.pop("num_experts", 4), **kw)
    router = TopKRouter(cfg, _state())
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return router


def test_softmax_topk_equals_mixtral_renormalization():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    probs, idx = topk_probs(logits, 2, "softmax")
    full = torch.softmax(logits, dim=-1)
    top, idx_ref = torch.topk(full, 2, dim=-1)
    assert torch.equal(idx, idx_ref)
    torch.testing.assert_close(probs, top / top.sum(-1, keepdim=True))
    # and Hugging Face's router on the same weights
    hf = MixtralTopKRouter(MixtralConfig(hidden_size=8, num_local_experts=4,
                                         num_experts_per_tok=2))
    router = _router(moe_router_topk=2)
    hf.weight.data.copy_(router.weight.data)
    x = torch.randn(6, 1, 8, generator=torch.Generator().manual_seed(2))
    _, hf_scores, hf_idx = hf(x.view(6, 8))
    routing = router(x)
    assert torch.equal(routing.routing_map, torch.zeros(6, 4, dtype=torch.bool).scatter(
        1, hf_idx, True))
    torch.testing.assert_close(routing.probs.gather(1, hf_idx), hf_scores)


def test_sigmoid_topk_with_scaling_by_hand():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0]])
    probs, idx = topk_probs(logits, 2, "sigmoid", scaling_factor=2.5)
    s1, s3 = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-2.0))
    assert idx.tolist() == [[3, 1]]
    torch.testing.assert_close(probs, torch.tensor([[s3, s1]]) / (s1 + s3) * 2.5)
    single, _ = topk_probs(logits, 1, "sigmoid")  # k = 1: no renormalization
    torch.testing.assert_close(single, torch.tensor([[s3]]))
    # aux-loss scores of sigmoid routing are normalized per token
    scores = scores_for_aux_loss(logits, "sigmoid")
    torch.testing.assert_close(scores.sum(-1), torch.ones(1))


def test_expert_capacity_formula():
    assert expert_capacity(10, 4, 2, 1.5) == 8  # ceil(10 * 2 / 4 * 1.5) = ceil(7.5)
    assert expert_capacity(4, 2, 1, 1.0) == 2
    assert expert_capacity(3, 2, 2, 2.0) == 3  # ceil(6), but at most the 3 tokens


def test_capacity_drop_policies_by_hand():
    # 4 tokens, 2 experts, top-1; expert 0 is wanted by tokens 0, 1, 2; capacity 2
    probs = torch.tensor([[0.9, 0.0], [0.6, 0.0], [0.8, 0.0], [0.0, 0.7]])
    routing_map = probs > 0
    p, m = apply_capacity(probs, routing_map, 2, "probs")
    assert m.tolist() == [[True, False], [False, False], [True, False], [False, True]]
    torch.testing.assert_close(p, probs * torch.tensor([[1.0], [0.0], [1.0], [1.0]]))
    _, m = apply_capacity(probs, routing_map, 2, "position")
    assert m.tolist() == [[True, False], [True, False], [False, False], [False, True]]
    # padding: expert 1 gets its token 3 plus the earliest probability-0 token
    p, m = apply_capacity(probs, routing_map, 2, "probs", pad_to_capacity=True)
    assert m.tolist() == [[True, True], [False, False], [True, False], [False, True]]
    assert m.sum(0).tolist() == [2, 2] and p[0, 1] == 0


def _loss_parts(router, x):
    logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), router.weight)
    return logits, router(x)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_formula(score):
    E, k, coeff = 4, 2, 0.3
    router = _router(moe_router_topk=k, moe_aux_loss_coeff=coeff,
                     moe_router_score_function=score)
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(3))
    logits, routing = _loss_parts(router, x)
    T = logits.shape[0]
    scores = scores_for_aux_loss(logits, score)
    f = routing.routing_map.float().sum(0) / (T * k)  # fraction of the T*k choices
    P = scores.mean(0)
    want = E * (f * P).sum() * coeff
    torch.testing.assert_close(routing.values["moe_aux_loss"], want)
    torch.testing.assert_close(routing.loss, want)
    assert "moe_z_loss" not in routing.values


def test_seq_aux_loss_is_per_sequence_mean():
    E, k, coeff, s, b = 4, 2, 0.1, 6, 3
    router = _router(moe_router_topk=k, moe_aux_loss_coeff=coeff,
                     moe_router_load_balancing_type="seq_aux_loss")
    x = torch.randn(s, b, 8, generator=torch.Generator().manual_seed(4))
    logits, routing = _loss_parts(router, x)
    per_seq = []
    for j in range(b):  # token t = i * b + j belongs to sequence j
        rows = torch.arange(s) * b + j
        f = routing.routing_map[rows].float().sum(0) / (s * k)
        P = torch.softmax(logits[rows], -1).mean(0)
        per_seq.append(E * (f * P).sum() * coeff)
    torch.testing.assert_close(routing.loss, torch.stack(per_seq).mean())


def test_z_loss_formula_and_no_loss_when_disabled():
    router = _router(moe_z_loss_coeff=0.01, moe_router_load_balancing_type="none",
                     moe_aux_loss_coeff=1.0)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(5))
    logits, routing = _loss_parts(router, x)
    want = torch.logsumexp(logits, -1).square().mean() * 0.01
    torch.testing.assert_close(routing.values["moe_z_loss"], want)
    assert list(routing.values) == ["moe_z_loss"]
    assert _router()(x).loss is None  # aux coeff 0 (the default) and no z-loss


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_attached_loss_reaches_gradient_with_scale(scale):
    router = _router(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(6))
    act = torch.randn(3, requires_grad=True)
    routing = router(x)
    out = AttachAuxLoss.apply(act * 2, routing.loss, scale)
    out.sum().backward()
    attached = router.weight.grad.clone()
    assert torch.equal(act.grad, torch.full((3,), 2.0))  # identity for the activation
    router.weight.grad = None
    (router(x).loss * scale).backward()
    torch.testing.assert_close(attached, router.weight.grad)
