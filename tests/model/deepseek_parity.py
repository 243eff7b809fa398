"""Checks the DeepSeek-V2 and V3 parity tests share: a converted tiny model (``hf``, a
transformers ``DeepseekV*ForCausalLM``; ``ours``, the megalite model loaded from it; ``cfg``
its config) round-trips its tensors, gives transformers' logits and greedy tokens."""

from __future__ import annotations

import torch

from megalite.config import ModelConfig
from megalite.inference.generation import generate
from megalite.models.families import family_of
from megalite.models.gpt import GPTModel
from tests.model.common import TINY, single_process_state

TOL = 1e-5
PROMPT = [3, 17, 41, 8, 29]


def our_config(spec, hf_cfg) -> ModelConfig:
    """``spec``'s conversion of the transformers config ``hf_cfg``, at the tiny test
    vocabulary and length."""
    return ModelConfig(**{**spec.config_from_hf(hf_cfg), **TINY})


def randomize(hf_model, seed=3):
    """O(1) weights everywhere (norms near one, V3's routing correction bias small and
    random) so a slip in any mapping shows in the logits; returns ``hf_model``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in hf_model.state_dict().items():
            noise = torch.randn(t.shape, generator=g)
            if "norm" in name:
                t.copy_(1.0 + 0.2 * noise)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * noise)
            else:
                t.copy_(0.15 * noise)
    return hf_model


def converted_pair(spec, hf_model_class, hf_cfg) -> tuple:
    """(transformers ``hf_model_class(hf_cfg)`` with :func:`randomize`d weights, in eval
    mode; the megalite model ``spec`` converts from it; its config)."""
    torch.manual_seed(0)
    hf = randomize(hf_model_class(hf_cfg).eval())
    ours, cfg = our_model(spec, hf)
    return hf, ours, cfg


def our_model(spec, hf) -> tuple[GPTModel, ModelConfig]:
    """(megalite model, its config) converted by ``spec`` from the transformers model
    ``hf``, holding its weights."""
    cfg = our_config(spec, hf.config)
    ours = GPTModel(cfg, single_process_state(), seed=1).eval()
    ours.load_full_state_dict(spec.from_hf(hf.state_dict(), cfg))
    return ours, cfg


def assert_state_dict_round_trip(spec, hf, ours, cfg) -> None:
    """The family is ``spec``; megalite -> transformers gives ``hf``'s tensors bit for bit,
    also split into the hub files' per-expert tensors, and back gives ``ours``'s."""
    assert family_of(cfg) is spec
    want = hf.state_dict()
    back = spec.to_hf(ours.full_state_dict(), cfg)
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[k], want[k]) for k in want)
    # hub files: per-expert gate_proj / up_proj / down_proj [out, in]
    hub = spec.to_hub_names(back, cfg)
    prefix = "model.layers.1.mlp.experts."
    assert prefix + "gate_up_proj" not in hub and prefix + "7.up_proj.weight" in hub
    f = cfg.moe_ffn_hidden_size
    assert torch.equal(hub[prefix + "5.up_proj.weight"], want[prefix + "gate_up_proj"][5, f:])
    assert torch.equal(hub[prefix + "2.down_proj.weight"], want[prefix + "down_proj"][2])
    again = spec.from_hf(hub, cfg)
    full = ours.full_state_dict()
    assert sorted(again) == sorted(full)
    assert all(torch.equal(again[k], full[k]) for k in full)


def assert_logits_match(case, hf, ours, cfg) -> None:
    """Logits of 2 random sequences of 16 tokens within TOL of transformers'."""
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)[..., :cfg.vocab_size]
    assert want.abs().max() > 1.0   # not a near-zero output
    assert (got - want).abs().max().item() < TOL, case


def assert_greedy_generation_matches(hf, ours, cfg) -> None:
    """Greedy continuation of PROMPT to the sequence length: transformers' tokens."""
    import transformers

    new = cfg.seq_length - len(PROMPT)
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT):]
    got = generate(ours, PROMPT, new)
    assert got == want.tolist()
    assert len(set(got)) > 1
