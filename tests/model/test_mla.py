"""Multi-latent attention against Hugging Face's ``DeepseekV3Attention``, and YaRN against
its RoPE tables: the same weights (copied by the name table of
``megalite.transformer.mla``), fp32, within 1e-5."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.config import ConfigError, ModelConfig
from megalite.models.gpt import GPTModel
from megalite.parallel.random import RNGTracker
from megalite.transformer.mla import MLASelfAttention, mla_softmax_scale
from megalite.transformer.yarn import YarnRotaryEmbedding
from tests.model.common import TINY, single_process_state

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

# megalite name -> Hugging Face name (the converter's table)
HF_NAMES = {"linear_q_down_proj.weight": "q_a_proj.weight",
            "q_layernorm.weight": "q_a_layernorm.weight",
            "linear_q_up_proj.weight": "q_b_proj.weight",
            "linear_q_proj.weight": "q_proj.weight",
            "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
            "kv_layernorm.weight": "kv_a_layernorm.weight",
            "linear_kv_up_proj.weight": "kv_b_proj.weight",
            "linear_proj.weight": "o_proj.weight"}

SEQ = 16


def mla_config(**overrides) -> ModelConfig:
    """A tiny DeepSeek-V3-style attention: q/kv latents, RoPE part 4, values 6 wide."""
    kw = {**TINY, "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
          "seq_length": SEQ, "normalization": "RMSNorm", "norm_epsilon": 1e-6,
          "add_bias_linear": False, "position_embedding_type": "rope",
          "multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 12,
          "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6,
          "rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
          "original_max_position_embeddings": 8, "init_method_std": 0.2}
    kw.update(overrides)
    return ModelConfig(**kw)


def hf_config(cfg: ModelConfig):
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_scaling_factor != 1.0:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base,
                "factor": cfg.rotary_scaling_factor, "mscale": cfg.mscale,
                "mscale_all_dim": cfg.mscale_all_dim,
                "original_max_position_embeddings": cfg.original_max_position_embeddings,
                "beta_fast": 32, "beta_slow": 1}
    c = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
        max_position_embeddings=4 * SEQ, rope_parameters=rope, rope_interleave=True,
        attention_bias=False, rms_norm_eps=cfg.norm_epsilon, num_hidden_layers=1,
        vocab_size=64)
    c._attn_implementation = "eager"
    return c


def _pair(cfg: ModelConfig):
    """(megalite layer, its rotary table, HF attention, HF rotary) with the same weights."""
    torch.manual_seed(0)
    ps = single_process_state()
    ours = MLASelfAttention(cfg, ps, sequence_parallel=False, rng=RNGTracker.from_state(ps, 1),
                            output_std=0.2)
    for p in ours.parameters():
        with torch.no_grad():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hcfg = hf_config(cfg)
    theirs = hf.DeepseekV3Attention(hcfg, layer_idx=0).eval()
    state = {HF_NAMES[n]: p.detach().clone() for n, p in ours.named_parameters()}
    missing = theirs.load_state_dict(state, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ours.eval(), YarnRotaryEmbedding(cfg), theirs, hf.DeepseekV3RotaryEmbedding(hcfg)


def _compare(cfg: ModelConfig, b: int = 2) -> float:
    ours, rotary, theirs, hf_rotary = _pair(cfg)
    x = torch.randn(b, SEQ, cfg.hidden_size)
    pos = torch.arange(SEQ).expand(b, SEQ)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(b, 1, SEQ, SEQ)
    with torch.no_grad():
        want, _ = theirs(x, hf_rotary(x, pos), mask)
        got = ours(x.transpose(0, 1), rotary(pos.t())).transpose(0, 1)
    assert got.shape == want.shape
    return (got - want).abs().max().item()


@pytest.mark.parametrize("overrides", [
    {},                                                        # DeepSeek-V3's shape, YaRN 40
    {"q_lora_rank": None},                                     # queries: one projection
    {"mscale": 0.707, "mscale_all_dim": 0.707},                # DeepSeek-V2-Lite's mscale
    {"mscale": 0.8, "mscale_all_dim": 1.0},                    # cos/sin scaled too
    {"rotary_scaling_factor": 1.0},                            # plain RoPE
    {"attention_backend": "local"},
], ids=["v3", "no-q-lora", "v2-lite", "mscale-ratio", "rope", "local"])
def test_matches_transformers(overrides):
    assert _compare(mla_config(**overrides)) < 1e-5


def test_yarn_tables_match_transformers():
    cfg = mla_config(qk_pos_emb_head_dim=16, original_max_position_embeddings=64,
                     mscale=0.9, mscale_all_dim=1.0)
    pos = torch.arange(300).expand(1, 300)
    cos, sin = YarnRotaryEmbedding(cfg)(pos.t())
    hcos, hsin = hf.DeepseekV3RotaryEmbedding(hf_config(cfg))(torch.zeros(1), pos)
    # ours [s, b, 1, d], theirs [b, s, d]
    assert torch.allclose(cos[:, 0, 0], hcos[0], atol=1e-6)
    assert torch.allclose(sin[:, 0, 0], hsin[0], atol=1e-6)
    ramp = YarnRotaryEmbedding(cfg).inv_freq
    plain = 1.0 / cfg.rotary_base ** (torch.arange(0, 16, 2).float() / 16)
    assert ramp[0] == plain[0] and ramp[-1] == pytest.approx(plain[-1] / 40)  # both ends


def test_softmax_scale():
    cfg = mla_config()
    assert mla_softmax_scale(cfg) == pytest.approx(
        (0.1 * math.log(40) + 1) ** 2 / math.sqrt(12))
    assert hf_config(cfg) is not None
    theirs = hf.DeepseekV3Attention(hf_config(cfg), 0)
    assert theirs.scaling == pytest.approx(mla_softmax_scale(cfg))


def test_model_trains_and_names_parameters():
    """A whole GPT with MLA builds, runs forward/backward, and every attention parameter
    has its Hugging Face counterpart."""
    cfg = mla_config(num_layers=2, vocab_size=50)
    model = GPTModel(cfg, single_process_state(), seed=3)
    ids = torch.randint(0, 50, (2, SEQ))
    loss = model(ids, labels=ids).mean()
    loss.backward()
    names = [n for n, _ in model.named_parameters() if ".self_attention." in n]
    assert {n.split(".self_attention.")[1] for n in names} == {
        k for k in HF_NAMES if k != "linear_q_proj.weight"}
    assert all(p.grad is not None for p in model.parameters())


NO_MLA = {"multi_latent_attention": False, "kv_lora_rank": None, "q_lora_rank": None,
          "qk_head_dim": None, "qk_pos_emb_head_dim": None, "v_head_dim": None,
          "original_max_position_embeddings": None, "rotary_scaling_factor": 1.0,
          "mscale_all_dim": 0.0}


@pytest.mark.parametrize("overrides, message", [
    ({**NO_MLA, "kv_lora_rank": 16}, "--kv-lora-rank needs --multi-latent-attention"),
    ({"qk_pos_emb_head_dim": 5}, "must be even"),
    ({"group_query_attention": True, "num_query_groups": 2}, "cannot be combined"),
    ({**NO_MLA, "rotary_scaling_factor": 40.0}, "YaRN"),
    ({"recompute_modules": ["mla_up_proj"]}, "needs --recompute-granularity selective"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act", "layernorm"]},
     "recompute_modules takes core_attn, layernorm, mla_up_proj, mlp, moe; got moe_act"),
])
def test_bad_input_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        mla_config(**overrides)


def test_flash_refuses_a_different_value_head_dim(monkeypatch):
    """flash-attn's kernel takes one head dim for q, k and v: asked for by name it is
    refused with the reason; ``auto`` takes sdpa instead (here flash counts as usable)."""
    from megalite.transformer.attention_kernels import select_attention_backend
    from megalite.transformer.attention_kernels.flash import FlashAttention

    monkeypatch.setattr(FlashAttention, "unavailable", classmethod(lambda cls, d, t: None))
    assert select_attention_backend("auto", "cpu", torch.bfloat16) == "flash"
    assert select_attention_backend("auto", "cpu", torch.bfloat16,
                                    same_head_dims=False) == "sdpa"
    with pytest.raises(ConfigError, match="--attention-backend flash needs value heads"):
        select_attention_backend("flash", "cpu", torch.bfloat16, same_head_dims=False)


def test_kv_cache_decoding_matches_one_forward():
    """Token-by-token decoding through the KV cache (the latent and the roped shared key;
    ``tests/inference/test_mla_cache.py`` has more) gives the logits of one forward."""
    from tests.inference.common import sequence_logits

    model = GPTModel(mla_config(num_layers=2, vocab_size=50), single_process_state(), seed=5)
    tokens = [3, 17, 8, 41, 0, 22, 9]
    full = sequence_logits(model, tokens, use_cache=False)
    cached = sequence_logits(model, tokens, use_cache=True)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


def test_launch_flags_of_deepseek_v3_parse():
    """The attention flags of a Megatron-LM DeepSeek-V3 launch script, as written."""
    from megalite.arguments import parse_args

    cfg = parse_args(
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 "
        "--mscale-all-dim 1.0 --qk-layernorm --recompute-granularity selective "
        "--recompute-modules mla_up_proj core_attn --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --vocab-size 100 --tokenizer-type "
        "NullTokenizer --position-embedding-type rope --normalization RMSNorm".split())
    m = cfg.model
    assert (m.q_lora_rank, m.kv_lora_rank, m.mla_q_head_dim, m.v_head_dim) == (1536, 512,
                                                                                192, 128)
    assert m.original_max_position_embeddings == 4096      # Megatron-Core's MLA default
    assert m.recomputes("mla_up_proj") and m.recomputes("core_attn")
    assert mla_softmax_scale(m) == pytest.approx((0.1 * math.log(40) + 1) ** 2 / 192 ** 0.5)


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_shared_expert_intermediate_size": 16}


@pytest.mark.parametrize("modules, recomputed, model_kw", [
    (["core_attn"], {"core_attention"}, {}),
    (["mla_up_proj"], {"linear_q_up_proj", "linear_kv_up_proj"}, {}),
    (["mla_up_proj", "core_attn"], {"linear_q_up_proj", "linear_kv_up_proj",
                                    "core_attention"}, {}),
    (["mlp"], {"linear_fc1"}, {}),   # fc2's input is recomputed: fc2 itself need not run
    (["layernorm"], {"input_layernorm", "pre_mlp_layernorm"}, {}),
    (["layernorm", "mlp"], {"input_layernorm", "pre_mlp_layernorm", "linear_fc1"}, {}),
    (["moe"], {"experts", "shared_experts"}, MOE),   # the router runs once
    (["moe", "layernorm"], {"experts", "shared_experts", "input_layernorm",
                            "pre_mlp_layernorm"}, MOE),
    (["mlp"], set(), MOE)])   # mlp covers dense MLPs only
def test_recompute_modules_run_their_parts_again(modules, recomputed, model_kw, monkeypatch):
    """--recompute-modules: the chosen parts run forward twice in a training step (once
    more in backward), the others once; the gradients do not change (multi-latent
    attention's own q / kv norms are not among ``layernorm``'s: Megatron's covers the
    layer's input and pre-MLP norms)."""
    from megalite.transformer.attention_kernels.sdpa import SdpaAttention

    calls: dict[str, int] = {}

    def count(name):
        calls[name] = calls.get(name, 0) + 1

    attend = SdpaAttention.attend
    monkeypatch.setattr(SdpaAttention, "attend",
                        lambda self, *a: count("core_attention") or attend(self, *a))
    grads = {}
    for mods in (None, modules):
        extra = {} if mods is None else {"recompute_granularity": "selective",
                                         "recompute_modules": mods}
        model = GPTModel(mla_config(num_layers=1, vocab_size=50, **model_kw, **extra),
                         single_process_state(), seed=3)
        calls.clear()
        layer = model.decoder.layers["0"]
        for name, mod in [*layer.self_attention.named_children(),
                          *([] if layer.is_moe else layer.mlp.named_children())]:
            if name != "core_attention":
                mod.register_forward_hook(lambda *_, name=name: count(name))
        # pre-hooks where a checkpointed region ends in the module: the recomputation stops
        # once it has every tensor that backward needs, before the last forward hooks run
        for name, mod in [("input_layernorm", layer.input_layernorm),
                          ("pre_mlp_layernorm", layer.pre_mlp_layernorm),
                          *(layer.mlp.named_children() if layer.is_moe else [])]:
            mod.register_forward_pre_hook(lambda *_, name=name: count(name))
        ids = torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).mean().backward()
        grads[mods is None] = {n: p.grad for n, p in model.named_parameters()}
        assert all(c in (1, 2) for c in calls.values()), calls
        assert {n for n, c in calls.items() if c == 2} == (recomputed if mods else set())
    for name, g in grads[True].items():
        torch.testing.assert_close(grads[False][name], g, rtol=0, atol=1e-6)


def test_fp8_runs_the_tp_split_projections_and_checks_their_tiling():
    """With ``--fp8-format`` the up and output projections (tp-split) carry the recipe and
    the replicated down projections do not; a latent rank the recipe cannot tile is named."""
    cfg = mla_config(num_layers=1, vocab_size=50, hidden_size=64, q_lora_rank=32,
                     kv_lora_rank=32, qk_head_dim=12, qk_pos_emb_head_dim=4, v_head_dim=8,
                     fp8_format="hybrid", fp8_recipe="tensorwise")
    cfg.check_fp8_tiling(tp=1, cp=1, micro_batch_size=2)
    model = GPTModel(cfg, single_process_state(), seed=3)
    attn = next(iter(model.decoder.layers.values())).self_attention
    assert all(getattr(attn, n).fp8_scaling is not None for n in
               ("linear_q_up_proj", "linear_kv_up_proj", "linear_proj"))
    assert not hasattr(attn.linear_kv_down_proj, "fp8_scaling")
    ids = torch.randint(0, 50, (2, SEQ))
    model(ids, labels=ids).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ConfigError, match="kv_lora_rank is 24"):
        mla_config(kv_lora_rank=24, fp8_format="e4m3", fp8_recipe="tensorwise",
                   hidden_size=64, q_lora_rank=32).check_fp8_tiling(1, 1, 2)
