"""--apply-layernorm-1p: zero-centred norm weights (stored w, applied 1 + w), initialised at
0, converted to and from Hugging Face by adding / subtracting one."""

import pytest
import torch

from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from megalite.parallel.params import param_meta
from megalite.transformer.norms import LayerNorm1p, RMSNorm1p, build_norm
from tests.model.common import batch, gpt2_config, llama_config, mixtral_config
from tests.model.common import single_process_state

H, EPS = 16, 1e-5


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_1p_norm_equals_plain_norm_with_weight_plus_one(kind):
    g = torch.Generator().manual_seed(0)
    one_p = build_norm(kind, H, EPS, zero_centered=True)
    plain = build_norm(kind, H, EPS)
    assert isinstance(one_p, LayerNorm1p if kind == "LayerNorm" else RMSNorm1p)
    assert param_meta(one_p.weight).init_fill == 0.0 and param_meta(plain.weight).init_fill == 1
    with torch.no_grad():
        one_p.weight.copy_(0.3 * torch.randn(H, generator=g))
        plain.weight.copy_(one_p.weight + 1)
        if kind == "LayerNorm":
            one_p.bias.copy_(torch.randn(H, generator=g))
            plain.bias.copy_(one_p.bias)
    x = torch.randn(4, 2, H, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    up = torch.randn(4, 2, H, generator=g)
    y, y2 = one_p(x), plain(x2)
    torch.testing.assert_close(y, y2, rtol=0, atol=1e-6)
    y.backward(up)
    y2.backward(up)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(one_p.weight.grad, plain.weight.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("make", [gpt2_config, llama_config, mixtral_config])
def test_model_inits_1p_norm_weights_at_zero(make):
    model = GPTModel(make(apply_layernorm_1p=True), single_process_state(), seed=1)
    norms = {n: p for n, p in model.named_parameters() if n.endswith("layernorm.weight")}
    assert len(norms) == 2 * model.config.num_layers + 1
    assert all(torch.count_nonzero(p) == 0 for p in norms.values())
    plain = GPTModel(make(), single_process_state(), seed=1).full_state_dict()
    ours = model.full_state_dict()
    # everything else is drawn exactly as without the flag
    assert all(torch.equal(ours[k], plain[k]) for k in plain if k not in norms)


def _hf_llama_state(cfg, seed=3):
    """A LlamaForCausalLM state dict with O(1) weights; norm weights in [0.5, 2]."""
    from transformers import LlamaForCausalLM

    spec = get_family("llama")
    hcfg = spec.hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(hcfg).eval()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in hf.state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        state[name] = ((1.0 + 0.2 * noise).clamp(0.5, 2.0) if name.endswith("norm.weight")
                       else 0.15 * noise)
    hf.load_state_dict(state)
    return hf, state


def test_llama_1p_matches_transformers_and_round_trips():
    cfg = llama_config(apply_layernorm_1p=True)
    spec = get_family("llama")
    hf, hf_state = _hf_llama_state(cfg)
    ours = spec.from_hf(hf_state, cfg)
    for name, t in ours.items():  # stored zero-centred
        if name.endswith("layernorm.weight"):
            hf_name = spec.to_hf({name: t}, cfg)
            assert torch.equal(t + 1, next(iter(hf_name.values())))
            assert t.abs().max() <= 1.0
    back = spec.to_hf(ours, cfg)
    assert sorted(back) == sorted(hf_state)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state), "not bit-identical"

    model = GPTModel(cfg, single_process_state(), seed=1).eval()
    model.load_full_state_dict(ours)
    ids, _ = batch(cfg)
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)[..., :cfg.vocab_size]
    assert (got - want).abs().max().item() < 1e-4
    # the same weights read without the flag are a different (wrong) model
    plain = GPTModel(llama_config(), single_process_state(), seed=1).eval()
    plain.load_full_state_dict(ours)
    with torch.no_grad():
        assert (plain(ids)[..., :cfg.vocab_size] - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("make", [gpt2_config, mixtral_config])
def test_other_families_shift_norm_weights(make):
    cfg, plain_cfg = make(apply_layernorm_1p=True), make()
    spec = get_family("gpt2" if make is gpt2_config else "mixtral")
    state = GPTModel(plain_cfg, single_process_state(), seed=1).full_state_dict()
    hf_plain = spec.to_hf(state, plain_cfg)
    zero_centred = {k: v - 1 if k.endswith("layernorm.weight") else v for k, v in state.items()}
    hf_1p = spec.to_hf(zero_centred, cfg)
    assert sorted(hf_1p) == sorted(hf_plain)
    assert all(torch.equal(hf_1p[k], hf_plain[k]) for k in hf_plain)
    back = spec.from_hf(hf_1p, cfg)
    assert all(torch.equal(back[k], zero_centred[k]) for k in state)
