"""DeepSeek-V3 through ``tools/convert_checkpoint.py``: a tiny random hub-style
``DeepseekV3ForCausalLM`` checkpoint (with one MTP module as layer 2, as the hub's keep
them) converts to megalite with ``--mtp-num-layers 1``; the converted checkpoint loads at
tp 2, pp 2 and tp 2 x ep 2 and gives transformers' logits and greedy tokens; converted
back it is the source's tensors bit for bit (the MTP module too) and config; it continues
training (the expert bias moving, the depth's loss logged)."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint.test_convert import (
    VOCAB,
    _safetensors,
    assert_same_export,
    convert,
    finetune_from,
)
from tests.distributed.harness import run_distributed
from tests.model.deepseek_parity import randomize
from tests.model.test_deepseek_v3_parity import hf_tiny_config

transformers = pytest.importorskip("transformers")

TOKENS = [5, 12, 44, 0, 7, 33, 21, 19, 48, 2, 10, 27]
PROMPT = [3, 17, 41, 8, 29]
NEW = 8
def _mtp_module(root: str, main: dict) -> dict:
    """Layer 2 of a 3-layer model as written to files, plus the MTP module's own tensors
    and copies of the main embedding and head (a hub checkpoint's MTP module)."""
    deeper = randomize(transformers.DeepseekV3ForCausalLM(
        hf_tiny_config(vocab_size=VOCAB, num_hidden_layers=3)), seed=4)
    deeper.save_pretrained(root)
    out = {k: v for k, v in load_file(os.path.join(root, "model.safetensors")).items()
           if k.startswith("model.layers.2.")}
    g, h = torch.Generator().manual_seed(5), 32
    out.update({"model.layers.2.enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                "model.layers.2.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                "model.layers.2.eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                "model.layers.2.shared_head.norm.weight": 1 + 0.2 * torch.randn(h,
                                                                                generator=g),
                "model.layers.2.embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
                "model.layers.2.shared_head.head.weight": main["lm_head.weight"].clone()})
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF source dir, megalite dir, printed output, HF logits [s, V] of TOKENS, HF greedy
    tokens after PROMPT)."""
    root = tmp_path_factory.mktemp("deepseek")
    src, mid = str(root / "hf"), str(root / "megalite")
    torch.manual_seed(0)
    hf = randomize(transformers.DeepseekV3ForCausalLM(
        hf_tiny_config(vocab_size=VOCAB, num_nextn_predict_layers=1)).eval())
    hf.save_pretrained(src)
    weights = os.path.join(src, "model.safetensors")
    state = load_file(weights)
    state.update(_mtp_module(str(root / "deeper"), state))   # as hub checkpoints keep MTP
    save_file(state, weights, metadata={"format": "pt"})
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        logits = hf(torch.tensor([TOKENS])).logits[0]
        greedy = hf.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT):]
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        convert("--source", "hf", "--target", "megalite", "--load-dir", src, "--save-dir", mid,
                "--target-tensor-parallel-size", "2")
    return src, mid, out.getvalue(), logits, greedy.tolist()


def test_mtp_converted_and_flags(converted):
    _, _, printed, _, _ = converted
    assert "dropped" not in printed
    for flag in ("--mtp-num-layers 1", "--multi-latent-attention", "--qk-layernorm",
                 "--q-lora-rank 12",
                 "--kv-lora-rank 16", "--moe-router-num-groups 4",
                 "--moe-router-group-topk 2", "--moe-router-enable-expert-bias",
                 "--moe-router-score-function sigmoid", "--moe-layer-freq '[0]*1+[1]*1'",
                 "--moe-shared-expert-intermediate-size 16", "--num-experts 8",
                 "--tensor-model-parallel-size 2"):
        assert flag in printed, flag


def _layout_body(rank, world_size, root, tp, pp, ep, etp):
    from megalite.inference.generation import generate
    from megalite.inference.loading import inference_state, load_model
    from tests.inference.common import sequence_logits

    ps = inference_state(tp, pp, ep, etp)
    _, model = load_model(root, None, ps)
    return sequence_logits(model, TOKENS, use_cache=False), generate(model, PROMPT, NEW)


@pytest.mark.parametrize("tp,pp,ep,etp", [(2, 1, 1, 2), (1, 2, 1, 1), (2, 1, 2, 1)],
                         ids=["tp2", "pp2", "tp2-ep2"])
def test_converted_checkpoint_matches_transformers_at_layouts(converted, tp, pp, ep, etp):
    _, mid, _, want, greedy = converted
    for logits, tokens in run_distributed(2, _layout_body, mid, tp, pp, ep, etp):
        assert (logits - want).abs().max().item() < 1e-5
        assert tokens == greedy
    assert len(set(greedy)) > 1


def test_megalite_to_hf_round_trip(converted, tmp_path):
    src, mid, _, _, _ = converted
    out = str(tmp_path / "back")
    convert("--source", "megalite", "--target", "hf", "--load-dir", mid, "--save-dir", out)
    back, b = assert_same_export(src, out, (
        "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "n_routed_experts",
        "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
        "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size", "rope_interleave"))
    assert "model.layers.2.eh_proj.weight" in back
    assert b["num_nextn_predict_layers"] == 1 and b["architectures"] == [
        "DeepseekV3ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    # bf16: the correction bias stays fp32, as on the hub (it decides the experts)
    bf16 = str(tmp_path / "bf16")
    convert("--source", "megalite", "--target", "hf", "--load-dir", mid, "--save-dir", bf16,
            "--dtype", "bf16")
    got = _safetensors(bf16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert got[bias].dtype == torch.float32 and torch.equal(got[bias], back[bias])
    assert got["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_converted_checkpoint_continues_training(converted, tmp_path):
    from megalite.training.loop import train

    src, mid, _, _, _ = converted
    c, want = finetune_from(src, mid, "deepseek_v3", str(tmp_path / "c"))
    bias = "decoder.layers.1.mlp.router.expert_bias"
    result = train(c)
    moved = not torch.equal(c.model.full_state_dict()[bias], want[bias])
    c.close()
    assert result.iteration == 3 and result.losses[3] < result.losses[1]
    assert moved
    assert c.cfg.model.mtp_num_layers == 1 and "mtp_1_loss" in result.moe_losses[3]


def test_trained_checkpoint_in_transformers_gives_our_logits(tmp_path, capsys):
    """A DeepSeek-V3 model trained here (tp 2, the expert bias moved by training) exported
    to HF: AutoModelForCausalLM gives its logits."""
    from megalite.checkpoint.consolidated import load_full_model
    from tests.model.common import deepseek_v3_config
    from tests.training.common import run_training, tiny_config

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    model = {k: v for k, v in deepseek_v3_config().__dict__.items()
             if k in ("multi_latent_attention", "qk_layernorm", "q_lora_rank", "kv_lora_rank",
                      "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
                      "moe_router_topk", "moe_ffn_hidden_size", "ffn_hidden_size",
                      "moe_shared_expert_intermediate_size", "moe_layer_freq",
                      "moe_router_num_groups", "moe_router_group_topk",
                      "moe_router_topk_scaling_factor", "moe_router_score_function",
                      "moe_router_enable_expert_bias", "moe_router_dtype",
                      "position_embedding_type", "normalization", "swiglu",
                      "add_bias_linear", "untie_embeddings_and_output_weights",
                      "norm_epsilon")}
    assert model["norm_epsilon"] == 1e-6   # transformers' latent norms' eps
    run_training(tiny_config(model=model, train={"train_iters": 3},
                             checkpoint={"save": save}))
    convert("--source", "megalite", "--target", "hf", "--load-dir", save, "--save-dir", out)
    assert "warning" not in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    _, ours = load_full_model(save)
    assert ours.full_state_dict()["decoder.layers.1.mlp.router.expert_bias"].abs().sum() > 0
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.eval()(ids)[..., :VOCAB]
    assert (got - want).abs().max().item() < 1e-5
