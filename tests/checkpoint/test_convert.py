"""Hugging Face <-> megalite conversion against the real ``transformers``:
HF -> megalite -> HF is bit-identical, a trained megalite checkpoint
converted to HF gives our logits in ``AutoModelForCausalLM``, and a converted HF model
continues training here."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megalite.checkpoint.consolidated import load_full_model
from megalite.models.families import get_family
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components
from megalite.training.loop import train
from tests.training.common import run_training, tiny_config
from tests.tools import load_tool

VOCAB = 61  # tiny_config's NullTokenizer: vocab_size 60 + 1
LLAMA = {**get_family("llama").defaults, "num_layers": 2, "hidden_size": 64,
         "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
         "ffn_hidden_size": 96}
MIXTRAL = {**get_family("mixtral").defaults, **LLAMA, "num_experts": 4, "moe_router_topk": 2}
FAMILY_MODEL = {"gpt2": {}, "llama": LLAMA, "mixtral": MIXTRAL}
FAMILIES = list(FAMILY_MODEL)


def _tool():
    return load_tool("convert_checkpoint")


def convert(*argv):
    assert _tool().main(list(argv)) == 0


def _hf_model(family):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                         activation_function="gelu")
        return GPT2LMHeadModel(cfg)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16,
                  tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=None))
    with torch.no_grad():  # HF inits norms to 1: perturb so a layout slip would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _safetensors(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def finetune_from(src: str, mid: str, family: str, save: str):
    """Build (in this process) training components for 3 iterations that load the megalite
    checkpoint ``mid`` converted from the HF checkpoint ``src`` with ``--finetune``, the
    model from ``src``'s config.json as the converter maps it for ``family`` (the tiny
    test run's vocabulary and sequence length). Asserts the model starts at ``src``'s
    tensors; returns (the components, ``src``'s tensors in megalite's names)."""
    import transformers

    from megalite.models.families import get_family
    from megalite.parallel.state import ParallelState
    from megalite.training.build import build_components
    from tests.training.common import tiny_config

    spec = get_family(family)
    model = {k: v for k, v in spec.config_from_hf(transformers.AutoConfig.from_pretrained(
        src, local_files_only=True)).items()
        if k not in ("vocab_size", "seq_length", "max_position_embeddings")}
    cfg = tiny_config(model=model, train={"train_iters": 3},
                      checkpoint={"load": mid, "finetune": True, "save": save})
    c = build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)
    want = spec.from_hf(load_file(os.path.join(src, "model.safetensors")), c.cfg.model)
    for name, tensor in c.model.full_state_dict().items():
        assert torch.equal(tensor, want[name]), name
    return c, want


def assert_same_export(src: str, out: str, config_keys=()) -> tuple[dict, dict]:
    """The HF checkpoint exported to ``out`` holds ``src``'s tensors bit for bit, under the
    same names, and its config.json the same value of each of ``config_keys``; returns
    (the exported tensors, the exported config)."""
    want, got = _safetensors(src), _safetensors(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    with open(os.path.join(src, "config.json")) as f, \
            open(os.path.join(out, "config.json")) as g:
        a, b = json.load(f), json.load(g)
    for key in config_keys:
        assert a.get(key) == b.get(key), key
    return got, b


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megalite_to_hf_is_bit_identical(tmp_path, family, capsys):
    src, mid, out = (str(tmp_path / n) for n in ("hf", "megalite", "back"))
    _hf_model(family).save_pretrained(src)
    convert("--source", "hf", "--target", "megalite", "--load-dir", src, "--save-dir", mid,
            "--target-tensor-parallel-size", "2")
    flags = capsys.readouterr().out
    assert "--tensor-model-parallel-size 2" in flags and "--finetune" in flags
    if family == "mixtral":
        assert "--num-experts 4 --moe-router-topk 2" in flags
    if family != "gpt2":
        assert "--group-query-attention" in flags and "--num-query-groups 4" in flags
    convert("--source", "megalite", "--target", "hf", "--load-dir", mid, "--save-dir", out,
            "--max-shard-size", "20KB")
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # sharded
    assert_same_export(src, out, ("model_type", "vocab_size", "num_attention_heads",
                                  "num_key_value_heads", "n_head", "n_layer",
                                  "num_hidden_layers", "tie_word_embeddings",
                                  "num_local_experts", "num_experts_per_tok"))


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_checkpoint_in_transformers_gives_our_logits(tmp_path, family):
    from transformers import AutoModelForCausalLM

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_training(tiny_config(model=FAMILY_MODEL[family], train={"train_iters": 3},
                             parallel={"tensor_model_parallel_size": 1},
                             checkpoint={"save": save}))
    convert("--source", "megalite", "--target", "hf", "--load-dir", save, "--save-dir", out)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    _, ours = load_full_model(save)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.eval()(ids)[..., :VOCAB]
    assert (got - want).abs().max().item() < 1e-4
    full = str(tmp_path / "full")
    convert("--source", "megalite", "--target", "megalite-consolidated", "--load-dir", save,
            "--save-dir", full, "--format", "safetensors")
    consolidated = load_file(os.path.join(full, "model.safetensors"))
    assert consolidated.keys() == ours.full_state_dict().keys()
    assert all(torch.equal(consolidated[k], v) for k, v in ours.full_state_dict().items())


def test_converted_hf_model_continues_training(tmp_path):
    src, conv = str(tmp_path / "hf"), str(tmp_path / "megalite")
    hf = _hf_model("llama")
    hf.save_pretrained(src)
    convert("--source", "hf", "--target", "megalite", "--load-dir", src, "--save-dir", conv)
    cfg = tiny_config(model=LLAMA, train={"train_iters": 3},
                      checkpoint={"load": conv, "finetune": True, "save": str(tmp_path / "c")})
    c = build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)
    want = get_family("llama").from_hf(hf.state_dict(), c.cfg.model)
    for name, tensor in c.model.full_state_dict().items():
        assert torch.equal(tensor, want[name]), name
    result = train(c)
    c.close()
    assert result.iteration == 3 and result.losses[3] < result.losses[1]


@pytest.mark.parametrize("flag", ["--target-tensor-parallel-size",
                                  "--target-pipeline-parallel-size",
                                  "--target-expert-model-parallel-size"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_target_size_below_one_is_one_usage_line(tmp_path, capsys, flag, value):
    """A target parallel size that is no integer >= 1: one usage error (exit 2) before
    anything is read or written, not a division by zero in the writer."""
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--source", "megalite", "--target", "megatron", "--load-dir",
                      str(tmp_path / "in"), "--save-dir", str(tmp_path / "out"), flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: argument {flag}: {value!r} is not a parallel size: "
                            "give an integer >= 1")
    assert not (tmp_path / "out").exists()
