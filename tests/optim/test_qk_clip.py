"""QK-clip (``--qk-clip``) and ``--log-max-attention-logit`` in one process, against direct
references: the per-head maximum logit against explicit scores (MHA, GQA, documents,
query chunks), the row factors on hand-made weights, a clip that brings the recomputed
maximum to the threshold exactly (MHA, GQA, multi-latent attention), the training step
against the unclipped step scaled by hand (AdamW and Muon), and the config errors."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.config import ConfigError
from megalite.optim.qk_clip import attention_layers, clip_factors
from megalite.parallel.random import RNGTracker
from megalite.parallel.state import ParallelState
from megalite.transformer import max_logits as ml
from megalite.transformer.attention import SelfAttention
from megalite.transformer.max_logits import head_max_logits
from megalite.transformer.mla import MLASelfAttention
from megalite.transformer.rope import RotaryEmbedding
from megalite.transformer.yarn import YarnRotaryEmbedding
from tests.layouts import MLA
from tests.optim.common import config, train_run
from tests.training.common import tiny_config


def _reference(q, k, document_ids=None):
    """Explicit fp32 scores ``[b, nh, s, s]`` with the causal (and document) mask -> per
    head max."""
    s, b, nh, d = q.shape
    kk = k.repeat_interleave(nh // k.shape[2], dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q.double(), kk.double()) / math.sqrt(d)
    keep = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if document_ids is not None:
        keep = keep & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_head_max_logits_against_explicit_scores(groups, monkeypatch):
    g = torch.Generator().manual_seed(0)
    s, b, nh, d = 12, 3, 4, 8
    q = torch.randn(s, b, nh, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    pos = torch.arange(s)
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 3 + [1] * 3 + [2] * 6])
    for document_ids in (None, docs):
        want = _reference(q, k, document_ids)
        torch.testing.assert_close(head_max_logits(q, k, pos, pos, document_ids), want)
        monkeypatch.setattr(ml, "CHUNK_ELEMENTS", b * nh * s * 5)   # 5 query rows a chunk
        torch.testing.assert_close(head_max_logits(q, k, pos, pos, document_ids), want)
        monkeypatch.undo()
    # the causal mask matters: a huge logit above the diagonal is not seen
    k2 = k.clone()
    k2[-1] = 100.0
    q2 = q.abs()
    got = head_max_logits(q2, k2, pos, pos)
    assert torch.all(got < head_max_logits(q2, k2, pos + 100, pos))   # all keys visible


def _attention(model: dict, alpha: float = 0.5, seed: int = 0):
    cfg = tiny_config(model={"qk_clip": True, "qk_clip_alpha": alpha, **model}).model
    ps = ParallelState.build(tiny_config().parallel)
    rng = RNGTracker(ps.device)
    torch.manual_seed(seed)
    pos = torch.arange(cfg.seq_length).unsqueeze(1)
    if cfg.multi_latent_attention:
        attn = MLASelfAttention(cfg, ps, sequence_parallel=False, rng=rng, output_std=0.02)
        rotary = YarnRotaryEmbedding(cfg)(pos)
    else:
        attn = SelfAttention(cfg, ps, sequence_parallel=False, rng=rng, output_std=0.02)
        rotary = RotaryEmbedding(cfg.kv_channels, base=cfg.rotary_base)(pos)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + p.numel()))
    return cfg, attn, rotary


def _observe(attn, cfg, rotary, x) -> torch.Tensor:
    attn.train()
    attn.max_logits.reset()
    with torch.no_grad():
        attn(x, rotary)
    return attn.max_logits.value.clone()


def _apply(factors: dict) -> None:
    with torch.no_grad():
        for p, f in factors.items():
            p.mul_(f)


GQA = {"position_embedding_type": "rope", "group_query_attention": True,
       "num_query_groups": 2, "add_qkv_bias": True}


@pytest.mark.parametrize("model", [{"position_embedding_type": "rope"}, GQA, MLA,
                                   {**MLA, "q_lora_rank": None}],
                         ids=["mha", "gqa-bias", "mla", "mla-no-q-lora"])
def test_clip_brings_the_largest_logit_to_the_threshold(model):
    """After the clip, each clipped head's (group's) largest logit is the threshold: the
    logits of a head scale by exactly ``eta`` (queries ``eta ** alpha``, keys ``eta ** (1 -
    alpha)``; MLA's RoPE query part ``eta``, the shared RoPE key untouched); the others
    keep theirs."""
    cfg, attn, rotary = _attention(model, alpha=0.3)
    x = torch.randn(cfg.seq_length, 2, cfg.hidden_size, generator=torch.Generator()
                    .manual_seed(3))
    before = _observe(attn, cfg, rotary, x)
    tau = float(before.median())      # about half of the heads above it
    factors = clip_factors(attn, [before], tau, 0.3)
    down = getattr(attn, "linear_kv_down_proj", None)
    shared = down.weight.clone() if down is not None else None
    _apply(factors)
    after = _observe(attn, cfg, rotary, x)
    groups = cfg.num_query_groups if not cfg.multi_latent_attention else cfg.num_attention_heads
    b_g = before.view(groups, -1).amax(dim=1)
    a_g = after.view(groups, -1).amax(dim=1)
    torch.testing.assert_close(a_g, torch.minimum(b_g, torch.tensor(tau)), rtol=1e-5,
                               atol=1e-6)
    assert bool((b_g > tau).any()) and bool((b_g <= tau).any())
    if shared is not None:
        assert torch.equal(down.weight, shared)   # the shared RoPE key is not clipped


def test_factors_on_hand_made_weights():
    """MHA, 4 heads of d 8, alpha 0.25: head h's query rows by eta_h ** 0.25, key rows by
    eta_h ** 0.75, value rows by 1, eta = min(1, tau / max)."""
    cfg, attn, _ = _attention({}, alpha=0.25)
    top = torch.tensor([50.0, 200.0, 100.0, 400.0])
    factors = clip_factors(attn, [top], 100.0, 0.25)
    eta = torch.tensor([1.0, 0.5, 1.0, 0.25])
    d = cfg.kv_channels
    want = torch.cat([(eta ** 0.25).repeat_interleave(d), (eta ** 0.75).repeat_interleave(d),
                      torch.ones(4 * d)])
    assert set(factors) == {attn.linear_qkv.weight, attn.linear_qkv.bias}
    torch.testing.assert_close(factors[attn.linear_qkv.weight].squeeze(1), want)
    assert clip_factors(attn, [top.clamp(max=100.0)], 100.0, 0.25) == {}   # none above


def test_tracking_leaves_the_output_alone():
    cfg, attn, rotary = _attention(GQA)
    x = torch.randn(cfg.seq_length, 2, cfg.hidden_size)
    attn.train()
    with_tracker = attn(x, rotary)
    attn.max_logits = None
    assert torch.equal(attn(x, rotary), with_tracker)


@pytest.mark.parametrize("optim", [{}, {"optimizer": "muon"}], ids=["adam", "muon"])
def test_step_is_the_unclipped_step_then_the_factors(optim):
    """One training step with --qk-clip equals the step without it (same logits, logged)
    followed by the factors applied to its parameters by hand."""
    model = {"qk_clip_threshold": 0.05}
    seen = {}

    def grab(c):
        seen["maxima"] = [m.max_logits.value.clone() for m in attention_layers(c.model)]

    plain = config(iters=1, model={"log_max_attention_logit": True}, optim=optim)
    _, ref, _, _ = train_run(plain, inspect=grab)
    clipped = config(iters=1, model={"qk_clip": True, **model}, optim=optim)
    _, got, _, _ = train_run(clipped)
    changed = 0
    for layer, top in enumerate(seen["maxima"]):
        assert float(top.max()) > 0.05       # the clip triggers
        cfg = clipped.model
        eta = torch.where(top > 0.05, 0.05 / top, torch.ones_like(top))
        d, nh = cfg.kv_channels, cfg.num_attention_heads
        rows = torch.cat([(eta ** 0.5).repeat_interleave(d), (eta ** 0.5).repeat_interleave(d),
                          torch.ones(nh * d)])
        for kind in ("weight", "bias"):
            name = f"decoder.layers.{layer}.self_attention.linear_qkv.{kind}"
            want = ref[name] * (rows.unsqueeze(1) if kind == "weight" else rows)
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7)
            changed += int(not torch.allclose(got[name], ref[name]))
    assert changed > 0
    for name, tensor in got.items():   # nothing else moved
        if "linear_qkv" not in name:
            torch.testing.assert_close(tensor, ref[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("model, message", [
    ({"qk_clip": True, "qk_clip_alpha": 1.0}, "--qk-clip-alpha must be between 0 and 1"),
    ({"qk_clip": True, "qk_clip_alpha": 0.0}, "--qk-clip-alpha must be between 0 and 1"),
    ({"qk_clip": True, "qk_clip_threshold": 0.0}, "--qk-clip-threshold must be > 0"),
    ({"qk_clip": True, "qk_layernorm": True}, "normalizes away"),
    ({"qk_clip_threshold": 50.0}, "--qk-clip-threshold (50.0) needs --qk-clip"),
    ({"qk_clip_alpha": 0.3}, "--qk-clip-alpha (0.3) needs --qk-clip"),
])
def test_config_errors(model, message):
    with pytest.raises(ConfigError) as err:
        tiny_config(model=model)
    assert message in str(err.value)


def test_mla_with_qk_norm_is_accepted():
    assert tiny_config(model={**MLA, "qk_clip": True}).model.qk_clip
