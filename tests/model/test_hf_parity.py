"""Logits match Hugging Face transformers on the same weights, at tp=1 and tp=2 (+/- SP)."""

import pytest
import torch

from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import FAMILIES, batch, single_process_state

TOL = 1e-4


def _random_weights(model, seed=7):
    """A full state dict with O(1) values so any layout error shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.full_state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        if "layernorm" in name:
            out[name] = (1.0 + 0.2 * noise) if name.endswith("weight") else 0.1 * noise
        elif name.endswith("bias"):
            out[name] = 0.1 * noise
        else:
            out[name] = 0.15 * noise
    return out


def _hf_reference(family):
    """(model config, our full state dict, HF logits [b, s, vocab], input ids)."""
    import transformers

    spec, cfg = get_family(family), FAMILIES[family]()
    ours = GPTModel(cfg, single_process_state(), seed=1)
    state = _random_weights(ours)
    hcfg = spec.hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hf = getattr(transformers, spec.hf_architecture)(hcfg).eval()
    result = hf.load_state_dict(spec.to_hf(state, cfg), strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    ids, _ = batch(cfg)
    with torch.no_grad():
        logits = hf(ids).logits
    return cfg, state, logits, ids


@pytest.fixture(scope="module")
def references():
    return {family: _hf_reference(family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_state_dict_round_trip(references, family):
    cfg, state, _, _ = references[family]
    spec = get_family(family)
    back = spec.from_hf(spec.to_hf(state, cfg), cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_tp1(references, family):
    cfg, state, want, ids = references[family]
    model = GPTModel(cfg, single_process_state(), seed=1).eval()
    model.load_full_state_dict(state)
    with torch.no_grad():
        got = model(ids)
    assert got.shape == (*ids.shape, cfg.padded_vocab_size(1))
    assert (got[..., :cfg.vocab_size] - want).abs().max().item() < TOL


def _tp2_body(rank, world_size, cases):
    diffs = {}
    for key, (cfg, state, want, ids) in cases.items():
        _family, sp = key
        with parallel_state(tensor_model_parallel_size=2, sequence_parallel=sp) as ps:
            model = GPTModel(cfg, ps, sequence_parallel=sp, seed=1).eval()
            model.load_full_state_dict(state)
            with torch.no_grad():
                local = model(ids)
                full = gather_from_tensor_model_parallel_region(local, ps.tp)
            diffs[key] = (local.shape[-1], (full[..., :cfg.vocab_size] - want).abs().max().item())
    return diffs


def test_logits_match_transformers_tp2(references):
    cases = {(family, sp): references[family] for family in FAMILIES for sp in (False, True)}
    for rank_diffs in run_distributed(2, _tp2_body, cases):
        for (family, sp), (local_vocab, diff) in rank_diffs.items():
            assert local_vocab == FAMILIES[family]().padded_vocab_size(2) // 2
            assert diff < TOL, (family, sp, diff)
