"""A megalite run written back for Megatron-LM to resume: the import of each trained
Megatron-Core fixture (``tests/checkpoint/megatron/fixtures/*_trained``, see
``test_megatron_resume.py``) exported again holds the optimizer state Megatron saved, bit
for bit -- the plain and the distributed optimizer's formats, Lion's betas, the chained
dense and expert optimizers of an expert-parallel run -- or, where Megatron's format does
not take the optimizer, the weights alone with a note that says why."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megalite.checkpoint.consolidated import checkpoint_config
from megalite.checkpoint.megatron import read_megatron
from megalite.checkpoint.megatron.files import find_checkpoint, read_common, read_tensors
from megalite.checkpoint.megatron.files import tensor_shapes
from tests.checkpoint.megatron.trained import TRAIN_STEPS as STEPS
from tests.checkpoint.test_megatron_import import FIXTURES, convert


def _same(a, b) -> bool:
    """Equal nested dicts / lists / tensors (dict order aside)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("name", ["llama_adam_trained", "llama_distopt_dp2_trained",
                                  "llama_bf16_trained", "llama_distopt_bf16_trained",
                                  "llama_sgd_trained", "llama_lion_trained",
                                  "llama_lion_bf16_trained", "mixtral_trained",
                                  "deepseek_v3_mtp_trained", "llama_fp16_trained",
                                  "mixtral_lion_trained"])
def test_export_writes_the_optimizer_state_megatron_saved(imported, tmp_path, capsys, name):
    """Megatron -> megalite -> Megatron: the export holds what Megatron-Core saved, bit for
    bit: every per-parameter state tensor (moments, momentum, fp32 main weights), the
    optimizer's parameter groups and step (and an fp16 run's loss scaler), the lr
    scheduler's state, the content metadata
    naming the format, the iteration and consumed samples. (Megatron-LM resuming from such
    exports takes its own next step exactly: ``make_fixtures.py --check-resume``.)"""
    save = str(tmp_path / "megatron")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported[name], "--save-dir", save, "--transformer-impl", "local") == 0
    out = capsys.readouterr().out
    distributed = "distopt" in name
    assert f"the {STEPS}-step optimizer state for " + (
        "--use-distributed-optimizer" if distributed else "the plain optimizer") in out
    assert "without --finetune, with" + (" or without" if "lion" in name else "" if distributed
                                         else "out") + " --use-distributed-optimizer" in out
    # an MoE run's state is written for ep 1, and the line says how to write it for more
    assert ("at --expert-model-parallel-size 1 (for a run at expert parallel N > 1 convert "
            "with --target-expert-model-parallel-size N" in out) == (
        "mixtral" in name or "deepseek" in name)
    theirs, ours = (find_checkpoint(p) for p in (os.path.join(FIXTURES, name), save))
    assert ours.iteration == theirs.iteration == STEPS
    a, b = read_common(theirs), read_common(ours)
    for key in ("optimizer", "opt_param_scheduler", "content_metadata", "iteration"):
        assert _same(a[key], b[key]), key
    assert b["args"].consumed_train_samples == a["args"].consumed_train_samples
    keys = [k for k in tensor_shapes(theirs) if k.startswith("optimizer.")]
    assert sorted(keys) == sorted(k for k in tensor_shapes(ours) if k.startswith("optimizer."))
    saved, written = read_tensors(theirs, keys), read_tensors(ours, keys)
    assert all(torch.equal(saved[k], written[k]) for k in keys)


def test_lion_runs_carry_the_betas_their_lion_took(imported, tmp_path, capsys):
    """Megatron-Core 0.19.2's --optimizer lion steps its Lion with --adam-beta1/2 (0.9,
    0.95 here) although the run gave --lion-beta2 0.99: the import takes the betas of the
    saved Lion groups. Lion's linear weights hold exp_avg alone, the AdamW ones both
    moments. The --use-distributed-optimizer run (Megatron keeps its optimizers plain,
    the keys prefixed by chained optimizer) exports to the same state, unprefixed."""
    cfg, _ = checkpoint_config(imported["llama_lion_trained"])
    assert cfg.optim.optimizer == "lion"
    assert (cfg.optim.lion_beta1, cfg.optim.lion_beta2) == (0.9, 0.95)
    state = read_megatron(os.path.join(FIXTURES, "llama_lion_trained")).optimizer.params
    assert set(state["decoder.layers.0.self_attention.linear_qkv.weight"]) == {"exp_avg"}
    assert set(state["embedding.word_embeddings.weight"]) == {"exp_avg", "exp_avg_sq"}
    name = "llama_lion_distopt_dp2_trained"
    save = str(tmp_path / "megatron")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported[name], "--save-dir", save, "--transformer-impl", "local") == 0
    assert "with or without --use-distributed-optimizer" in capsys.readouterr().out
    theirs, ours = (find_checkpoint(p) for p in (os.path.join(FIXTURES, name), save))
    keys = {k: re.sub(r"^chained_\d+\.", "", k) for k in tensor_shapes(theirs)
            if "optimizer.state." in k}
    assert all(k.startswith("chained_") for k in keys)
    saved, written = read_tensors(theirs, list(keys)), read_tensors(ours, list(keys.values()))
    assert all(torch.equal(saved[k], written[plain]) for k, plain in keys.items())
    assert _same(read_common(theirs)["optimizer"], read_common(ours)["optimizer"])


def test_export_for_expert_parallel_megatron_runs_chains_two_optimizers(imported, tmp_path,
                                                                         capsys):
    """For a Megatron run at --expert-model-parallel-size 2, the dense and the expert
    optimizer each get their saved state (Megatron's chained layout: entries 0 and 1, the
    expert groups marked); the default-format import of such a run round-trips to it."""
    name = "mixtral_distopt_ep2_buckets_trained"
    save = str(tmp_path / "megatron")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported[name], "--save-dir", save, "--transformer-impl", "local",
                   "--target-expert-model-parallel-size", "2") == 0
    assert ", at --expert-model-parallel-size 2:" in capsys.readouterr().out
    common = read_common(find_checkpoint(save))
    chained = common["optimizer"]
    assert sorted(chained) == [0, 1] and common["args"].expert_model_parallel_size == 2
    for index, experts in ((0, False), (1, True)):
        groups = chained[index]["optimizer"]["param_groups"]
        assert {g["is_expert_parallel"] for g in groups} == {experts}
        assert {g["step"] for g in groups} == {float(STEPS)}
    # the state equals the one read from Megatron's flat buckets
    ckpt = find_checkpoint(save)
    keys = [k for k in tensor_shapes(ckpt) if k.startswith("optimizer.state.")]
    written = read_megatron(save).optimizer.params
    source = read_megatron(os.path.join(FIXTURES, name)).optimizer.params
    assert {k.split(".")[2] for k in keys} == {"param", "exp_avg", "exp_avg_sq"}
    assert written.keys() == source.keys()
    assert all(torch.equal(written[p][s], source[p][s]) for p in source for s in source[p])


def test_lion_moe_export_for_expert_parallel_chains_an_expert_lion(imported, tmp_path):
    """A Lion MoE run for a Megatron run at --expert-model-parallel-size 2: what Megatron
    saved, bit for bit: a dense Lion, the experts' Lion (groups marked expert-parallel),
    then the Adam of the rest, each per-parameter state tensor unprefixed. At ep 1 the
    experts share the dense Lion (``mixtral_lion_trained`` in the test above)."""
    name = "mixtral_lion_ep2_trained"
    save = str(tmp_path / "megatron")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported[name], "--save-dir", save, "--transformer-impl", "local",
                   "--target-expert-model-parallel-size", "2") == 0
    theirs, ours = (find_checkpoint(p) for p in (os.path.join(FIXTURES, name), save))
    a, b = read_common(theirs), read_common(ours)
    assert sorted(b["optimizer"]) == [0, 1, 2]
    assert [{g["is_expert_parallel"] for g in b["optimizer"][i]["param_groups"]}
            for i in range(3)] == [{False}, {True}, {False}]
    for key in ("optimizer", "opt_param_scheduler", "content_metadata", "iteration"):
        assert _same(a[key], b[key]), key
    keys = [k for k in tensor_shapes(theirs) if k.startswith("optimizer.")]
    assert sorted(keys) == sorted(k for k in tensor_shapes(ours) if k.startswith("optimizer."))
    saved, written = read_tensors(theirs, keys), read_tensors(ours, keys)
    assert all(torch.equal(saved[k], written[k]) for k in keys)


def test_export_without_optimizer_state_says_why(imported, tmp_path, capsys):
    """--no-load-optim, or an optimizer Megatron's format is not written for (SGD under the
    distributed optimizer), gives a weights-only export and a --finetune hint."""
    save = str(tmp_path / "weights")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported["llama_adam_trained"], "--save-dir", save, "--no-load-optim") == 0
    out = capsys.readouterr().out
    assert ", weights only)" in out and "--finetune" in out
    common = read_common(find_checkpoint(save))
    assert "optimizer" not in common and common["args"].no_save_optim
    assert not [k for k in tensor_shapes(find_checkpoint(save)) if k.startswith("optimizer.")]
    save = str(tmp_path / "sgd")
    assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                   imported["llama_sgd_trained"], "--save-dir", save,
                   "--target-optimizer-format", "distributed") == 0
    out = capsys.readouterr().out
    assert "note: the optimizer state is not written (Megatron-Core's distributed " \
        "optimizer takes Adam, not SGD" in out and "--finetune" in out
