"""Multi-latent attention's latent KV cache: generation caches the normalised kv latent and
the roped shared key per token and layer, decodes with the absorbed up projections, and
equals the uncached full-sequence forward (fp32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch

from megalite.inference.generation import generate, generate_batch
from megalite.inference.kv_cache import InferenceCache
from megalite.models.gpt import GPTModel
from megalite.transformer.mla import MLASelfAttention, latent_cache_values_per_token
from tests.inference.common import sequence_logits
from tests.model.common import single_process_state
from tests.model.test_mla import mla_config

TOKENS = [3, 17, 8, 41, 0, 22, 9, 30, 5, 12, 44, 7]
VARIANTS = {"v3": {}, "no-q-lora": {"q_lora_rank": None},
            "v2-lite-mscale": {"mscale": 0.707, "mscale_all_dim": 0.707},
            "rope": {"rotary_scaling_factor": 1.0}}


def _model(**overrides) -> GPTModel:
    cfg = mla_config(num_layers=2, vocab_size=50, **overrides)
    return GPTModel(cfg, single_process_state(), seed=5).eval()


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_latent_cache_logits_equal_full_forward(overrides, monkeypatch):
    """Token by token (every step after the first through the absorbed form), and a
    prompt of 5 then chunks of 4 and 1: the logits of one uncached forward."""
    model = _model(**overrides)
    full = sequence_logits(model, TOKENS, use_cache=False)
    up_proj_calls = []
    up_proj = MLASelfAttention._up_proj_and_rope
    monkeypatch.setattr(MLASelfAttention, "_up_proj_and_rope",
                        lambda self, *a: up_proj_calls.append(1) or up_proj(self, *a))
    stepped = sequence_logits(model, TOKENS, use_cache=True)
    assert len(up_proj_calls) == 2   # the first token only, once per layer
    torch.testing.assert_close(stepped, full, rtol=0, atol=1e-5)
    cache = InferenceCache(len(TOKENS))
    with torch.no_grad():
        parts = [model(torch.tensor([TOKENS[a:b]]), inference_cache=cache)[0, :, :50]
                 for a, b in [(0, 5), (5, 9), (9, 10)]]
    assert cache.seq_len == 10
    torch.testing.assert_close(torch.cat(parts), full[:10], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}], ids=["v3", "no-q-lora"])
def test_greedy_generation_equals_uncached(overrides):
    model = _model(**overrides)
    prompts = [[3, 17, 8, 41, 0], [22], [9, 30, 5, 12, 44, 7, 1, 2]]
    alone = [generate(model, p, 8) for p in prompts]
    assert alone == [generate(model, p, 8, use_cache=False) for p in prompts]
    assert any(len(set(a)) > 1 for a in alone)
    # left-padded batch: pad keys masked in the absorbed form too
    assert generate_batch(model, prompts, 8) == alone
    assert generate_batch(model, prompts, 8, use_cache=False) == alone


def test_cache_holds_latent_and_rope_key_only():
    """Per token and layer: kv_lora_rank + qk_pos_emb_head_dim values, not the heads'
    keys and values."""
    model = _model()
    cfg = model.config
    cache = InferenceCache(7)
    with torch.no_grad():
        model(torch.tensor([TOKENS[:4], TOKENS[4:8]]), inference_cache=cache)
    for i in sorted(int(n) for n in model.decoder.layers):
        layer = cache.layer(i)
        assert layer.k.shape == (7, 2, 1, cfg.kv_lora_rank)
        assert layer.v.shape == (7, 2, 1, cfg.qk_pos_emb_head_dim)
        assert (layer.k.numel() + layer.v.numel()) // (7 * 2) == sum(
            latent_cache_values_per_token(cfg)[:1])
    assert latent_cache_values_per_token(cfg) == (16 + 4, 4 * (8 + 4 + 6))


def test_deepseek_v3_cache_values_per_token():
    """DeepSeek-V3's shape: 512 + 64 = 576 values against 128 heads x (192 + 128)."""
    cfg = mla_config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                     kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                     v_head_dim=128)
    latent, full = latent_cache_values_per_token(cfg)
    assert (latent, full) == (576, 40960)
    assert round(full / latent) == 71
    # docs/deepseek.md's table: bf16 (2 bytes a value), 61 layers
    assert (2 * latent, 2 * full, 2 * 61 * latent, 2 * 61 * full) == (1152, 81920, 70272,
                                                                      4997120)


def test_tp2_latent_cache_generation_equals_tp1(tmp_path):
    """A checkpoint saved at tp=1 generates at tp=2 what one process generates: each rank
    caches the whole latent and RoPE key (one group of kv_lora_rank / dr values) and
    absorbs its own heads' rows of linear_kv_up_proj."""
    from megalite.checkpoint.consolidated import save_full_model
    from megalite.config import MegaliteConfig
    from tests.distributed.harness import run_distributed
    from tests.inference.common import on_rank, run_layout
    from tests.model.test_hf_parity import _random_weights

    cfg = MegaliteConfig(model=mla_config(num_layers=2, vocab_size=50))
    save_full_model(cfg, _random_weights(GPTModel(cfg.model, single_process_state(),
                                                  seed=1)), str(tmp_path))
    one = run_layout(str(tmp_path))
    two = run_distributed(2, on_rank, str(tmp_path), 2)
    assert one["cached_groups"] == 1
    torch.testing.assert_close(one["logits"], one["full"], rtol=0, atol=1e-5)
    assert any(len(set(g)) > 1 for g in one["greedy"])
    for rank in two:
        assert rank["cached_groups"] == 1
        assert rank["greedy"] == one["greedy"] and rank["batch"] == one["greedy"]
        torch.testing.assert_close(rank["logits"], one["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(rank["full"], one["logits"], rtol=0, atol=1e-5)
