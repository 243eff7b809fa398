"""Megatron-Core torch_dist checkpoints -> megalite, against checkpoints Megatron-Core
itself saved (``tests/checkpoint/megatron/fixtures``, written by ``make_fixtures.py``
with megatron-core 0.19.2; CI needs no Megatron): the imported model's logits equal the
Megatron model's, at one process and resharded; training continues from the import;
what cannot be imported is refused in one line with exit code 4."""

import argparse
import json
import os
import shlex
import shutil
import subprocess

import pytest
import torch

from megalite.checkpoint.consolidated import load_full_model
from megalite.checkpoint.megatron.files import _Opaque, find_checkpoint, read_common
from megalite.checkpoint.megatron.mapping import qkv_from_megatron, qkv_to_megatron
from megalite.models.families import family_of
from tests.distributed.harness import run_distributed
from tests.tools import load_tool
from tests.training.common import ENTRYPOINT, PYTHON, read_jsonl, subprocess_env

FIXTURES = os.path.join(os.path.dirname(__file__), "megatron", "fixtures")
# fixtures with logits.pt (the *_trained ones, saved with optimizer state after training
# steps, record the next step instead: test_megatron_resume.py)
NAMES = sorted(n for n in os.listdir(FIXTURES) if not n.endswith("_trained"))
TRAINED = sorted(n for n in os.listdir(FIXTURES) if n.endswith("_trained"))
DIST_NAMES = [n for n in NAMES if not n.endswith("_legacy")]   # torch_dist
# the Hugging Face family of each fixture's model (None: none has multi-latent attention
# with a dense MLP, or a DeepSeek-V3 router with standard attention)
FAMILY = {"gpt2": "gpt2", "llama": "llama", "mixtral": "mixtral", "qwen3": "qwen3", "mla": None,
          "moe": None, "deepseek": "deepseek_v3"}
TOLERANCE = 1e-5


def convert(*argv) -> int:
    return load_tool("convert_checkpoint").main(list(argv))


def convert_fixtures(names, tmp_path_factory) -> dict[str, str]:
    """{fixture name: the megalite checkpoint converted from it}."""
    out = {}
    for name in names:
        save = str(tmp_path_factory.mktemp(name))
        assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                       os.path.join(FIXTURES, name), "--save-dir", save) == 0
        out[name] = save
    return out


class Imported(dict):
    """{fixture name: the megalite checkpoint converted from it}, each converted the first
    time it is asked for (a test module's share of the fixtures, not all of them)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name: str) -> str:
        self[name] = convert_fixtures([name], self.tmp_path_factory)[name]
        return self[name]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert_fixtures(NAMES, tmp_path_factory)


def _reference(name):
    """(tokens [b, s], Megatron's logits [b, s, V]) saved with the fixture."""
    ref = torch.load(os.path.join(FIXTURES, name, "logits.pt"))
    return ref["tokens"], ref["logits"]


def depth_logits(model, tokens):
    """Each prediction depth's logits ``[N, b, s, V]`` of ``model`` (one process, eval) on
    ``tokens`` ``[b, s]``: its output layer's calls before the main head's."""
    from megalite.transformer.mtp import roll_for_mtp

    calls = []
    hook = model.output_layer.register_forward_hook(lambda m, i, o: calls.append(o))
    labels = torch.roll(tokens, -1, dims=1)
    rolled = roll_for_mtp({"tokens": tokens, "labels": labels,
                           "loss_mask": torch.ones_like(tokens)}, model.config.mtp_num_layers)
    try:
        with torch.no_grad():
            model.eval()(tokens, labels=labels, mtp_tokens=rolled["mtp_tokens"],
                         mtp_labels=rolled["mtp_labels"])
    finally:
        hook.remove()
    return torch.stack([c.transpose(0, 1) for c in calls[:-1]])


def test_fixtures_are_megatron_core_checkpoints():
    assert {"gpt2_tp1_pp1", "gpt2_tp2_pp2", "llama_tp1_pp1", "llama_tp2_pp2",
            "mixtral_tp1_pp1", "mixtral_ep2", "llama_pp2_vpp2", "gpt2_tp2_pp2_legacy",
            "llama_tp2_pp2_legacy", "mixtral_ep2_legacy", "llama_pp2_vpp2_legacy",
            "qwen3_tp1_pp1", "qwen3_tp2_pp2", "mla_tp2_pp2", "mla_noqlora_pp2",
            "moe_bias_ep2", "llama_mtp_tp2_pp2", "llama_mtp_tp2_pp2_legacy",
            "deepseek_v3_mtp_ep2"} <= set(NAMES)
    for name in NAMES:
        ckpt = find_checkpoint(os.path.join(FIXTURES, name))
        assert ckpt.iteration == 1
        if name in DIST_NAMES:
            assert ckpt.format == "torch_dist"
            assert os.path.exists(os.path.join(ckpt.directory, ".metadata"))
            args = read_common(ckpt)["args"]
            with open(os.path.join(FIXTURES, name, "fixture.json")) as f:
                made = json.load(f)
            assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == \
                (made["tp"], made["pp"])
        else:
            assert ckpt.format == "legacy"
            assert all(n.startswith("mp_rank_") for n in os.listdir(ckpt.directory))


@pytest.mark.parametrize("name", NAMES)
def test_imported_logits_equal_megatrons(converted, name):
    cfg, model = load_full_model(converted[name])
    family = FAMILY[name.split("_")[0]]
    if family is None:
        with pytest.raises(ValueError, match="no Hugging Face family"):
            family_of(cfg.model)
    else:
        assert family_of(cfg.model).name == family
    tokens, want = _reference(name)
    with torch.no_grad():
        got = model.eval()(tokens)
    vocab = cfg.model.vocab_size   # NullTokenizer 100 + eod; Megatron pads to 112 or 128
    assert vocab == 101 and want.shape[-1] >= vocab
    assert (got[..., :vocab] - want[..., :vocab]).abs().max().item() <= TOLERANCE
    depths = torch.load(os.path.join(FIXTURES, name, "logits.pt")).get("mtp_logits")
    assert (depths is not None) == ("_mtp_" in name) == bool(cfg.model.mtp_num_layers)
    if depths is not None:   # each prediction depth's logits too
        got = depth_logits(model, tokens)
        assert got.shape[0] == depths.shape[0] == cfg.model.mtp_num_layers
        assert (got[..., :vocab] - depths[..., :vocab]).abs().max().item() <= TOLERANCE


def test_qkv_interleave_round_trips():
    w = torch.randn((8 + 2 * 2) * 3, 5)      # 8 heads, 2 groups, head dim 3
    ours = qkv_from_megatron(w, 8, 2, 3)
    assert torch.equal(qkv_to_megatron(ours, 8, 2, 3), w)
    # group 1's first q head (Megatron rows 18..20) is our head 4
    assert torch.equal(ours[12:15], w[18:21])


def _layout_logits(rank, world_size, root, tp, pp, tokens, ep=1):
    from megalite.inference.loading import inference_state, load_model
    from tests.inference.common import sequence_logits

    state = inference_state(tp, pp, ep, 1) if ep > 1 else inference_state(tp, pp)
    _, model = load_model(root, None, state)
    return torch.stack([sequence_logits(model, row.tolist(), use_cache=False)
                        for row in tokens])


@pytest.mark.parametrize("name,tp,pp,ep", [
    ("llama_tp2_pp2", 2, 1, 1), ("gpt2_tp2_pp2", 1, 2, 1), ("qwen3_tp2_pp2", 2, 1, 1),
    ("mla_tp2_pp2", 2, 1, 1), ("mla_noqlora_pp2", 2, 1, 1), ("moe_bias_ep2", 2, 1, 2)])
def test_imported_checkpoint_loads_resharded(converted, name, tp, pp, ep):
    """Saved by Megatron at tp2 x pp2 (or pp2, ep2), imported, loaded at tp2 (or pp2, or
    tp2 with the experts over ep2): the same logits."""
    tokens, want = _reference(name)
    for got in run_distributed(tp * pp, _layout_logits, converted[name], tp, pp, tokens,
                               ep):
        assert (got - want[..., :got.shape[-1]]).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", ["llama_tp1_pp1", "moe_bias_ep2", "deepseek_v3_mtp_ep2"])
def test_pretrain_finetunes_from_an_import(tmp_path, capsys, name):
    """The flags the converter prints train on from the import (--finetune), prediction
    depths included; the imported expert biases (the depth's too) are where the bias
    updates start from."""
    save = str(tmp_path / "imported")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.join(FIXTURES, name), "--save-dir", save) == 0
    printed = capsys.readouterr().out
    flags = shlex.split(printed.split("pretrain/pretrain_gpt.py ", 1)[1].split(" --load ")[0])
    assert "--swiglu" in flags and ("--num-query-groups" in flags
                                    or "--multi-latent-attention" in flags)
    assert ("--mtp-num-layers" in flags) == ("_mtp_" in name)
    run = tmp_path / "run"
    proc = subprocess.run(
        [PYTHON, ENTRYPOINT, *flags, "--load", save, "--finetune", "--save", str(run / "ck"),
         "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
         "--attention-backend", "sdpa", "--metrics-jsonl", str(run / "m.jsonl")],
        env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(str(run / "m.jsonl"))
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(0 < r["lm_loss"] < 10 for r in rows), rows   # ln(101) = 4.6 from scratch
    assert all(0 < r["mtp_1_loss"] < 10 for r in rows) if "_mtp_" in name else True, rows
    assert os.path.exists(run / "ck" / "iter_0000002")
    imported, trained = (load_full_model(d)[1].state_dict() for d in (save, str(run / "ck")))
    biases = [k for k in imported if k.endswith("expert_bias")]
    assert len(biases) == {"moe_bias_ep2": 2, "deepseek_v3_mtp_ep2": 2}.get(name, 0)
    for key in biases:   # two steps of --moe-router-bias-update-rate 1e-3 from the import
        step = (trained[key] - imported[key]).abs()
        assert imported[key].abs().min() > 0.01 and 0 < step.max() <= 2e-3 + 1e-6, key


# -- errors --------------------------------------------------------------------------------------
def _one_line_error(capsys, *argv) -> str:
    assert convert(*argv) == 4
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_checkpoint: error: "), lines
    return lines[0]


def _from_megatron(load, save, *extra):
    """The converter's flags, spelled --load / --save as the other tools do."""
    return ("--source", "megatron", "--target", "megalite", "--load", str(load),
            "--save", str(save), *extra)


def test_megatron_source_errors_are_one_line(tmp_path, capsys):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    line = _one_line_error(capsys, *_from_megatron(foreign, tmp_path / "o"))
    assert "is not a Megatron-LM checkpoint" in line
    line = _one_line_error(capsys, *_from_megatron(tmp_path / "absent", tmp_path / "o"))
    assert "does not exist" in line

    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00_000").mkdir(parents=True)
    (legacy / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt").write_bytes(b"")
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    line = _one_line_error(capsys, *_from_megatron(legacy, tmp_path / "o"))
    assert "mp_rank_00_000/model_optim_rng.pt cannot be read" in line
    for rank in ("mp_rank_00_000", "mp_rank_01_001"):   # of tp2 x pp2: two missing
        (legacy / "iter_0000005" / rank).mkdir(exist_ok=True)
        torch.save({"args": argparse.Namespace(pipeline_model_parallel_size=2)},
                   legacy / "iter_0000005" / rank / "model_optim_rng.pt")
    line = _one_line_error(capsys, *_from_megatron(legacy, tmp_path / "o"))
    assert "rank files missing for (tp, pp, ep)" in line

    ours = tmp_path / "ours"
    assert convert(*_from_megatron(os.path.join(FIXTURES, "gpt2_tp1_pp1"), ours)) == 0
    capsys.readouterr()
    line = _one_line_error(capsys, *_from_megatron(ours, tmp_path / "o"))
    assert "is a megalite checkpoint, not a Megatron-LM one (use --source megalite)" in line

    fixture = os.path.join(FIXTURES, "llama_tp1_pp1")
    line = _one_line_error(capsys, *_from_megatron(fixture, tmp_path / "o", "--ckpt-step", "7"))
    assert "has no Megatron iteration 7; available: iter_0000001" in line


def test_megatron_fsdp_formats_name_the_conversion(tmp_path, capsys):
    """A torch_dcp / fsdp_dtensor checkpoint (Megatron-FSDP: DCP entries ``model.<module
    name>`` and ``args``, no common state) is named, with Megatron-LM's own conversion."""
    import warnings

    import torch.distributed.checkpoint as dcp

    root = tmp_path / "fsdp"
    directory = root / "iter_0000010"
    directory.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    with warnings.catch_warnings():   # "assuming ... a single process": it is one
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model.decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(4, 2),
                  "iteration": 10}, storage_writer=dcp.FileSystemWriter(str(directory)),
                 no_dist=True)
    line = _one_line_error(capsys, *_from_megatron(root, tmp_path / "o"))
    assert "is a Megatron-LM torch_dcp or fsdp_dtensor checkpoint" in line
    assert f"--load {root} --ckpt-convert-format torch_dist --ckpt-convert-save" in line


def test_unmapped_model_is_refused(tmp_path, capsys):
    """A feature megalite's model lacks (here one layer shared by the prediction depths and
    a gated shared expert, read from common.pt as older Megatron-Core versions write it) is
    named, not imported with other logits."""
    root = _with_args(tmp_path, "deepseek_v3_mtp_ep2", mtp_use_repeated_layer=True,
                      moe_shared_expert_gate=True)
    line = _one_line_error(capsys, *_from_megatron(root, tmp_path / "o"))
    assert "--mtp-use-repeated-layer (one layer shared by the prediction depths)" in line
    assert "--moe-shared-expert-gate" in line and "megalite imports" in line


def test_deepseek_routing_args_and_expert_bias_are_imported(converted):
    """The router flags come from the args, and each MoE layer's saved expert bias (seeded
    noise, so that it changes the routing) is its router's ``expert_bias``."""
    from megalite.checkpoint.megatron.files import read_tensors

    cfg, model = load_full_model(converted["moe_bias_ep2"])
    m = cfg.model
    assert (m.moe_layer_freq, m.moe_shared_expert_intermediate_size, m.moe_router_num_groups,
            m.moe_router_group_topk, m.moe_router_score_function,
            m.moe_router_topk_scaling_factor, m.moe_router_enable_expert_bias) == \
        ("[0,1,1]", 32, 2, 1, "sigmoid", 2.5, True)
    ckpt = find_checkpoint(os.path.join(FIXTURES, "moe_bias_ep2"))
    keys = [f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2)]
    saved = read_tensors(ckpt, keys)
    state = model.state_dict()
    assert "decoder.layers.0.mlp.router.expert_bias" not in state   # the dense layer
    for key in keys:
        assert saved[key].abs().min() > 0
        assert torch.equal(state[key], saved[key])


def test_transformer_engine_names_of_mla_norms_are_read():
    """Transformer Engine's spec saves multi-latent attention's latent norms inside the up
    projections (``linear_q_up_proj.layer_norm_weight``) and the pre-MLP norm inside
    ``linear_fc1``: the same megalite state as the local spec's names."""
    from megalite.checkpoint.megatron import arguments, mapping
    from megalite.checkpoint.megatron.files import read_tensors, tensor_shapes
    from megalite.config import ModelConfig

    ckpt = find_checkpoint(os.path.join(FIXTURES, "mla_tp2_pp2"))
    shapes = tensor_shapes(ckpt)
    tensors = read_tensors(ckpt, [k for k in shapes if mapping.is_model_key(k)])
    chunks = {k: v[1] for k, v in shapes.items()}
    cfg = ModelConfig(**arguments.model_kwargs(read_common(ckpt)["args"]))
    want = mapping.to_megalite(tensors, chunks, cfg)
    te = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
          "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
          "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    renamed, renamed_chunks = {}, {}
    for key, t in tensors.items():
        new = key
        for local, fused in te.items():
            new = new.replace(mapping.LAYERS + local, mapping.LAYERS + fused)
        renamed[new], renamed_chunks[new] = t, chunks[key]
    assert len(set(renamed) - set(tensors)) == 3 and not mapping.unknown_keys(renamed)
    got = mapping.to_megalite(renamed, renamed_chunks, cfg)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_multi_latent_attention_args_are_imported(converted):
    cfg, _ = load_full_model(converted["mla_tp2_pp2"])
    m = cfg.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim,
            m.qk_pos_emb_head_dim, m.v_head_dim, m.qk_layernorm, m.rotary_scaling_factor,
            m.mscale, m.mscale_all_dim, m.original_max_position_embeddings) == \
        (True, 16, 16, 8, 8, 8, True, 4.0, 1.0, 0.8, 4096)
    assert load_full_model(converted["mla_noqlora_pp2"])[0].model.q_lora_rank is None


def test_args_that_name_tensors_the_checkpoint_lacks_are_one_line(tmp_path, capsys):
    """Args with --qk-layernorm over a checkpoint without q/k norms: the missing tensors are
    named in one line."""
    root = _with_args(tmp_path, "llama_tp1_pp1", qk_layernorm=True)
    line = _one_line_error(capsys, *_from_megatron(root, tmp_path / "o"))
    assert "missing ['decoder.layers.0.self_attention.k_layernorm.weight'" in line


def test_hf_source_that_is_not_hf_is_one_line(tmp_path, capsys):
    def from_hf(load):
        return ("--source", "hf", "--target", "megalite", "--load-dir", str(load),
                "--save-dir", str(tmp_path / "o"))

    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line_error(capsys, *from_hf(empty))
    assert f"{empty} is not a Hugging Face checkpoint: it has no config.json" in line
    line = _one_line_error(capsys, *from_hf(os.path.join(FIXTURES, "gpt2_tp1_pp1")))
    assert "use --source megatron" in line
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 8}')
    line = _one_line_error(capsys, *from_hf(bad))
    assert "config.json is not a usable Hugging Face config" in line


def _with_args(tmp_path, name, **changes):
    """A copy of fixture ``name`` whose args (in a common.pt, as older Megatron-Core
    writes them) have ``changes``."""
    root = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), root)
    ckpt = find_checkpoint(str(root))
    args = read_common(ckpt)["args"]
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if not isinstance(v, _Opaque)})
    vars(plain).update(changes)
    torch.save({"args": plain, "iteration": 1, "checkpoint_version": 3.0},
               os.path.join(ckpt.directory, "common.pt"))
    return root


def test_vocabulary_comes_from_the_recorded_tokenizer(tmp_path, capsys):
    """A Hugging Face tokenizer the args name: its size is the model's vocabulary (the
    rows past it are Megatron's padding); without its files, the padded rows stay."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.data.test_tokenizers import TEXT

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=90,
                                                             special_tokens=["<unk>", "</s>"]))
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    root = _with_args(tmp_path, "llama_tp1_pp1", tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=path, vocab_size=None)
    save = str(tmp_path / "imported")
    assert convert(*_from_megatron(root, save)) == 0
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {path}" in \
        capsys.readouterr().out
    cfg, model = load_full_model(save)
    assert cfg.model.vocab_size == tok.get_vocab_size() <= 90
    tokens, want = _reference("llama_tp1_pp1")
    tokens = tokens % cfg.model.vocab_size
    with torch.no_grad():
        got = model.eval()(tokens)[..., :cfg.model.vocab_size]
    ref = _imported_logits(tmp_path, "llama_tp1_pp1", tokens)[..., :cfg.model.vocab_size]
    assert (got - ref).abs().max().item() <= TOLERANCE

    os.remove(path)
    assert convert(*_from_megatron(root, str(tmp_path / "again"))) == 0
    out = capsys.readouterr().out
    assert "note: the tokenizer cannot be built here" in out and "112 padded rows" in out
    assert load_full_model(str(tmp_path / "again"))[0].model.vocab_size == 112


def _imported_logits(tmp_path, name, tokens):
    save = str(tmp_path / f"plain_{name}")
    assert convert(*_from_megatron(os.path.join(FIXTURES, name), save)) == 0
    with torch.no_grad():
        return load_full_model(save)[1].eval()(tokens)


@pytest.mark.parametrize("name", ["llama_tp1_pp1", "gpt2_tp2_pp2_legacy"])
def test_megalite_tools_name_a_megatron_checkpoint_and_the_conversion(name):
    """A Megatron checkpoint given to a megalite tool (not the converter) is named as one,
    with the conversion command, in one line."""
    from megalite.checkpoint.files import CheckpointError, read_metadata
    from megalite.checkpoint.megatron.files import find_checkpoint

    ckpt = find_checkpoint(os.path.join(FIXTURES, name))
    with pytest.raises(CheckpointError, match="Megatron-LM checkpoint.*--source megatron "
                                              "--target megalite"):
        read_metadata(ckpt.directory)
