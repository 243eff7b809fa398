"""Mixtral: logits match ``transformers.MixtralForCausalLM`` on the same weights, at tp=1
and under tensor x expert parallelism on 4 ranks; the name mapping round-trips (both the
in-memory v5 names and the hub files' per-expert w1/w2/w3)."""

import pytest
import torch

from megalite.config import ModelConfig
from megalite.models.families import family_for_hf, get_family
from megalite.models.gpt import GPTModel
from megalite.parallel.mappings import gather_from_tensor_model_parallel_region
from tests.distributed.harness import parallel_state, run_distributed
from tests.layouts import layouts
from tests.model.common import batch, mixtral_config, single_process_state

TOL = 1e-4
LAYOUTS = layouts("mixtral")   # tp x sp x ep x etp on 4 ranks (tests/layouts.py)
MIXTRAL = get_family("mixtral")


def _random_weights(model, seed=7):
    """A full state dict with O(1) values, so a layout or mapping error shows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.full_state_dict().items():
        noise = torch.randn(t.shape, generator=g)
        out[name] = 1.0 + 0.2 * noise if "layernorm" in name else 0.15 * noise
    return out


@pytest.fixture(scope="module")
def reference():
    """(config, our full state dict, HF state dict, HF logits [b, s, vocab], input ids)."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config()
    state = _random_weights(GPTModel(cfg, single_process_state(), seed=1))
    hcfg = MIXTRAL.hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hf = MixtralForCausalLM(hcfg).eval()
    hf_state = MIXTRAL.to_hf(state, cfg)
    hf.load_state_dict(hf_state, strict=True)
    ids, _ = batch(cfg)
    with torch.no_grad():
        logits = hf(ids).logits
    return cfg, state, hf_state, logits, ids


def test_state_dict_round_trips(reference):
    cfg, state, hf_state, _, _ = reference
    back = MIXTRAL.from_hf(hf_state, cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # hub checkpoint files: block_sparse_moe.gate and experts.<j>.w1 / w2 / w3 [out, in]
    hub = {k: v for k, v in hf_state.items() if ".mlp." not in k}
    f = cfg.moe_ffn_hidden_size
    for i in range(cfg.num_layers):
        moe, src = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        hub[moe + "gate.weight"] = hf_state[src + "gate.weight"]
        for j in range(cfg.num_experts):
            gate_up, down = hf_state[src + "experts.gate_up_proj"][j], \
                hf_state[src + "experts.down_proj"][j]
            hub[f"{moe}experts.{j}.w1.weight"] = gate_up[:f]
            hub[f"{moe}experts.{j}.w3.weight"] = gate_up[f:]
            hub[f"{moe}experts.{j}.w2.weight"] = down
    assert MIXTRAL.to_hub_names(hf_state, cfg).keys() == hub.keys()
    back = MIXTRAL.from_hf(hub, cfg)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_config_round_trip_and_refusals(reference):
    cfg = reference[0]
    hcfg = MIXTRAL.hf_config(cfg)
    assert family_for_hf(hcfg.model_type) is MIXTRAL
    kwargs = MIXTRAL.config_from_hf(hcfg)
    again = ModelConfig(**{**kwargs, "seq_length": cfg.seq_length})
    for name in ("num_layers", "hidden_size", "num_query_groups", "kv_channels",
                 "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "rotary_base",
                 "untie_embeddings_and_output_weights", "add_bias_linear", "swiglu"):
        assert getattr(again, name) == getattr(cfg, name), name
    with pytest.raises(ValueError, match="moe-router-score-function sigmoid"):
        MIXTRAL.hf_config(mixtral_config(moe_router_score_function="sigmoid"))
    with pytest.raises(ValueError, match="moe-layer-freq 2"):
        MIXTRAL.to_hf({}, mixtral_config(moe_layer_freq=2))


def test_logits_match_transformers_tp1(reference):
    cfg, state, _, want, ids = reference
    model = GPTModel(cfg, single_process_state(), seed=1).eval()
    model.load_full_state_dict(state)
    with torch.no_grad():
        got = model(ids)
    assert (got[..., :cfg.vocab_size] - want).abs().max().item() < TOL


def _layouts_body(rank, world_size, cfg, state, want, ids):
    out = []
    for layout in LAYOUTS:
        with parallel_state(**layout.parallel) as ps:
            model = GPTModel(cfg, ps, sequence_parallel=layout.get("sp"), seed=1).eval()
            model.load_full_state_dict(state)
            local_experts = model.decoder.layers["0"].mlp.experts.fc1.shape[0]
            full = model.full_state_dict()  # gathers experts over etp and ep
            same = all(torch.equal(full[k], state[k]) for k in state)
            with torch.no_grad():
                logits = gather_from_tensor_model_parallel_region(model(ids), ps.tp)
            diff = (logits[..., :cfg.vocab_size] - want).abs().max().item()
            out.append((local_experts, same, diff))
    return out


def test_logits_match_transformers_tp_ep(reference):
    cfg, state, _, want, ids = reference
    for rank_out in run_distributed(4, _layouts_body, cfg, state, want, ids):
        for layout, (local_experts, same, diff) in zip(LAYOUTS, rank_out):
            assert local_experts == cfg.num_experts // layout.get("ep"), layout.name
            assert same, layout.name
            assert diff < TOL, (layout.name, diff)
