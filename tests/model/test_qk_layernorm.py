"""``--qk-layernorm`` on standard attention against Hugging Face's ``Qwen3Attention``
(per-head RMSNorm of queries and keys before RoPE), same weights, fp32, within 1e-5; and
the LayerNorm kind against an explicit per-head layer norm."""

from __future__ import annotations

import pytest
import torch

from megalite.parallel.random import RNGTracker
from megalite.transformer.attention import SelfAttention
from megalite.transformer.rope import RotaryEmbedding
from tests.model.common import llama_config, single_process_state

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3 import modeling_qwen3 as hf  # noqa: E402

SEQ = 16


def _attention(cfg):
    torch.manual_seed(0)
    ps = single_process_state()
    attn = SelfAttention(cfg, ps, sequence_parallel=False, rng=RNGTracker.from_state(ps, 1),
                         output_std=0.2)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return attn.eval()


def test_rmsnorm_matches_qwen3():
    cfg = llama_config(qk_layernorm=True, norm_epsilon=1e-6)
    ours = _attention(cfg)
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hcfg = transformers.Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=nh,
                                    num_key_value_heads=ng, head_dim=d, rms_norm_eps=1e-6,
                                    attention_bias=False, num_hidden_layers=1)
    hcfg._attn_implementation = "eager"
    theirs = hf.Qwen3Attention(hcfg, layer_idx=0).eval()
    q, k, v = ours.linear_qkv.weight.detach().split([nh * d, ng * d, ng * d])
    theirs.load_state_dict({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
                            "o_proj.weight": ours.linear_proj.weight.detach(),
                            "q_norm.weight": ours.q_layernorm.weight.detach(),
                            "k_norm.weight": ours.k_layernorm.weight.detach()})
    x = torch.randn(2, SEQ, cfg.hidden_size)
    pos = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(2, 1, SEQ, SEQ)
    with torch.no_grad():
        want, _ = theirs(x, hf.Qwen3RotaryEmbedding(hcfg)(x, pos), mask)
        got = ours(x.transpose(0, 1), RotaryEmbedding(d)(pos.t())).transpose(0, 1)
    assert (got - want).abs().max().item() < 1e-5


def test_layernorm_is_per_head():
    cfg = llama_config(qk_layernorm=True, normalization="LayerNorm",
                       position_embedding_type="none")
    attn = _attention(cfg)
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    x = torch.randn(SEQ, 2, cfg.hidden_size)
    with torch.no_grad():
        q, k, v = attn.linear_qkv(x).split([nh * d, ng * d, ng * d], dim=-1)
        q = torch.nn.functional.layer_norm(q.view(SEQ, 2, nh, d), (d,),
                                           attn.q_layernorm.weight, attn.q_layernorm.bias)
        k = torch.nn.functional.layer_norm(k.view(SEQ, 2, ng, d), (d,),
                                           attn.k_layernorm.weight, attn.k_layernorm.bias)
        ctx = torch.nn.functional.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
            v.view(SEQ, 2, ng, d).permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)
        want = attn.linear_proj(ctx.permute(2, 0, 1, 3).reshape(SEQ, 2, nh * d))
        assert torch.allclose(attn(x), want, atol=1e-6)
        # the norms change the result (they are not the identity here)
        attn.q_layernorm = attn.k_layernorm = None
        assert not torch.allclose(attn(x), want, atol=1e-3)
