"""DeepSeek-V2 through ``tools/convert_checkpoint.py``: tiny random ``DeepseekV2ForCausalLM``
checkpoints written by ``save_pretrained`` (V2-Lite's shape: no query latent, greedy
routing; V2's: query latent, group_limited_greedy, scaled, YaRN) convert to megalite with
the routing flags printed; the converted checkpoint gives transformers' logits (in one
process, and for V2's shape at tp 2 x ep 2); converted back it is the source's tensors bit
for bit and its config; it continues training; configs megalite cannot compute alike are
refused by the tool."""

import io
import json
import os
from contextlib import redirect_stdout

import pytest
import torch

from megalite.errors import EXIT_CHECKPOINT
from tests.checkpoint.test_convert import VOCAB, _tool, assert_same_export, convert, finetune_from
from tests.distributed.harness import run_distributed
from tests.model.deepseek_parity import randomize
from tests.model.test_deepseek_v2_parity import FULL, LITE, hf_tiny_config

transformers = pytest.importorskip("transformers")

TOKENS = [5, 12, 44, 0, 7, 33, 21, 19, 48, 2, 10, 27]
CASES = {"v2-lite": LITE, "v2": FULL}
FLAGS = {"v2-lite": ("--moe-router-pre-softmax", "--moe-layer-freq '[0]*1+[1]*1'",
                     "--kv-lora-rank 16", "--moe-shared-expert-intermediate-size 32",
                     "--num-experts 8", "--moe-router-topk 2"),
         "v2": ("--moe-router-pre-softmax", "--q-lora-rank 12", "--moe-router-num-groups 4",
                "--moe-router-group-topk 2", "--moe-router-topk 3",
                "--moe-router-topk-scaling-factor 2.5", "--moe-layer-freq '[0]*1+[1]*2'",
                "--rotary-scaling-factor 4.0", "--mscale-all-dim 0.707")}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, HF source dir, megalite dir, printed output, HF logits [s, V] of TOKENS)."""
    root = tmp_path_factory.mktemp(request.param)
    src, mid = str(root / "hf"), str(root / "megalite")
    torch.manual_seed(0)
    hf = randomize(transformers.DeepseekV2ForCausalLM(
        hf_tiny_config(vocab_size=VOCAB, **CASES[request.param])).eval())
    hf.save_pretrained(src)
    with torch.no_grad():
        logits = hf(torch.tensor([TOKENS])).logits[0]
    out = io.StringIO()
    with redirect_stdout(out):
        convert("--source", "hf", "--target", "megalite", "--load-dir", src, "--save-dir", mid)
    return request.param, src, mid, out.getvalue(), logits


def test_flags_printed(converted):
    case, _, _, printed, _ = converted
    assert "dropped" not in printed and "deepseek_v2" in printed
    for flag in ("--multi-latent-attention", "--qk-layernorm", *FLAGS[case]):
        assert flag in printed, flag
    # softmax is the flag's default, so not printed
    assert "--moe-router-enable-expert-bias" not in printed and "sigmoid" not in printed
    assert ("--q-lora-rank" in printed) == (case == "v2")


def test_converted_checkpoint_matches_transformers(converted):
    from megalite.checkpoint.consolidated import load_full_model

    _, _, mid, _, want = converted
    _, model = load_full_model(mid)
    with torch.no_grad():
        got = model.eval()(torch.tensor([TOKENS]))[0, :, :VOCAB]
    assert want.abs().max() > 1.0
    assert (got - want).abs().max().item() < 1e-5


def _layout_body(rank, world_size, root, tp, pp, ep, etp):
    from megalite.inference.loading import inference_state, load_model
    from tests.inference.common import sequence_logits

    ps = inference_state(tp, pp, ep, etp)
    _, model = load_model(root, None, ps)
    return sequence_logits(model, TOKENS, use_cache=False)


def test_converted_v2_matches_transformers_at_tp2_ep2(converted):
    case, _, mid, _, want = converted
    if case != "v2":
        pytest.skip("one layout, on the V2 shape (groups, query latent)")
    for logits in run_distributed(2, _layout_body, mid, 2, 1, 2, 1):
        assert (logits - want).abs().max().item() < 1e-5


def test_megalite_to_hf_round_trip(converted, tmp_path, capsys):
    case, src, mid, _, _ = converted
    out = str(tmp_path / "back")
    convert("--source", "megalite", "--target", "hf", "--load-dir", mid, "--save-dir", out)
    assert "warning" not in capsys.readouterr().out
    got, b = assert_same_export(src, out, (
        "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "n_routed_experts",
        "n_shared_experts", "n_group", "topk_group", "topk_method", "norm_topk_prob",
        "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
        "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "moe_intermediate_size", "rope_parameters"))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in got
    assert b["architectures"] == ["DeepseekV2ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(hf).__name__ == "DeepseekV2ForCausalLM"


def test_tool_refuses_what_megalite_computes_otherwise(converted, tmp_path, capsys):
    """V2's own top-6 of 3 groups (a group's best 2 summed here, its best 1 there) and
    norm_topk_prob true: one line naming the field, nothing written."""
    case, src, _, _, _ = converted
    if case != "v2":
        pytest.skip("once")
    with open(os.path.join(src, "config.json")) as f:
        base = json.load(f)
    for change, match in [({"num_experts_per_tok": 4}, "num_experts_per_tok 4 // topk_group 2"),
                          ({"norm_topk_prob": True}, "norm_topk_prob true")]:
        bad = tmp_path / match.split()[0]
        bad.mkdir()
        for name in os.listdir(src):
            if name != "config.json":
                os.symlink(os.path.join(src, name), bad / name)
        (bad / "config.json").write_text(json.dumps({**base, **change}))
        code = _tool().main(["--source", "hf", "--target", "megalite", "--load-dir", str(bad),
                             "--save-dir", str(tmp_path / "never")])
        err = capsys.readouterr().err
        assert code == EXIT_CHECKPOINT and match in err, err
        assert "DeepSeek-V2 config megalite cannot represent" in err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "never").exists()


def test_converted_checkpoint_continues_training(converted, tmp_path):
    """--load DIR --finetune with the printed architecture: the model starts from the
    source's tensors and its loss falls."""
    from megalite.training.loop import train

    case, src, mid, _, _ = converted
    if case != "v2":
        pytest.skip("once, on the V2 shape")
    c, _ = finetune_from(src, mid, "deepseek_v2", str(tmp_path / "c"))
    result = train(c)
    c.close()
    assert result.iteration == 3 and result.losses[3] < result.losses[1]
