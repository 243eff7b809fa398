"""A Megatron-LM run resumed in megalite: checkpoints Megatron-Core trained for two steps
and saved with its optimizer state (``tests/checkpoint/megatron/fixtures/*_trained``,
written by ``make_fixtures.py`` with Megatron-Core's DDP, optimizer and Megatron-LM's lr
scheduler: Adam without and with the distributed optimizer at dp 2, SGD with momentum,
a Mixtral (Megatron chains a dense and an expert optimizer), a DeepSeek-V3 shape
(multi-latent attention, group-limited sigmoid routing whose expert bias moves, shared
experts, a prediction depth in the objective), and bf16 weights with fp32 main copies)
import with the moments, step count, fp32 masters, the lr schedule's position and the
consumed samples, and megalite's next step on the batch Megatron's next step took
(``next_step.pt``) gives Megatron's loss, learning rate and weights."""

from __future__ import annotations

import argparse
import os
import re
import shutil

import pytest
import torch

from megalite.checkpoint.consolidated import checkpoint_config
from megalite.checkpoint.files import iteration_dir, read_metadata
from megalite.checkpoint.megatron import buckets, mapping, read_megatron
from megalite.checkpoint.megatron.files import _Opaque, find_checkpoint, load_pickled, read_common
from megalite.checkpoint.megatron.files import read_tensors, tensor_shapes
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components
from megalite.training.loop import train_step
from tests.checkpoint.megatron.trained import TRAIN_STEPS as STEPS
from tests.checkpoint.test_megatron_import import FIXTURES, TRAINED, convert
from tests.optim.common import DATASETS


def _next_step(root: str, name: str):
    """megalite's step after ``root``'s iteration on the batch of Megatron's next step:
    (StepResult, full weights after it, Megatron's record, the resumed state: iteration,
    samples, optimizer steps and, after the step, the loss scaler's state)."""
    cfg, iteration = checkpoint_config(root)
    cfg.checkpoint.load, cfg.checkpoint.no_load_rng = root, True
    cfg.data.mock_data = True
    cfg.validate(1)
    want = torch.load(os.path.join(FIXTURES, name, "next_step.pt"))
    batches = [{"tokens": t, "labels": labels, "loss_mask": torch.ones(t.shape),
                "position_ids": torch.arange(t.shape[1]).expand(t.shape)}
               for t, labels in zip(want["tokens"], want["labels"])]
    ps = ParallelState.build(cfg.parallel)
    c = build_components(cfg, ps, datasets_provider=DATASETS, peak_probe_seconds=0.01)
    try:
        state = (c.state.iteration, c.state.consumed_train_samples, c.optimizer.num_steps)
        result = train_step(c, batches, iteration + 1)
        state += (c.optimizer.scaler.state_dict(),)
        weights = c.model.full_state_dict()
    finally:
        c.close()
        ps.destroy()
    if "params" in want:
        params = _stack_local_experts(want["params"])
        chunks = {k: [((0,) * v.dim(), tuple(v.shape))] for k, v in params.items()}
        after = mapping.to_megalite(params, chunks, cfg.model)
    else:   # a tensor-parallel run: its weights after the step, saved as a checkpoint
        after = read_megatron(os.path.join(FIXTURES, name, "after_next_step"),
                              load_optim=False).state
    return result, weights, want, after, state


def _stack_local_experts(params: dict) -> dict:
    """Megatron's module names -> its sharded keys where they differ: the local spec's
    experts ``mlp.experts.local_experts.<j>.linear_fc<n>.weight`` stacked ``[E, ...]`` as
    ``mlp.experts.experts.linear_fc<n>.weight``."""
    out, experts = {}, {}
    for key, t in params.items():
        m = re.match(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$", key)
        if m is None:
            out[key] = t
        else:
            experts.setdefault(m[1] + "experts." + m[3], {})[int(m[2])] = t
    out.update({k: torch.stack([by[j] for j in sorted(by)]) for k, by in experts.items()})
    return out


def test_trained_fixtures_hold_megatrons_optimizer_state():
    assert TRAINED == ["deepseek_v3_mtp_trained", "llama_adam_trained", "llama_bf16_trained",
                       "llama_distopt_bf16_trained", "llama_distopt_buckets_trained",
                       "llama_distopt_dp2_trained", "llama_distopt_pp2_buckets_trained",
                       "llama_distopt_tp2_buckets_trained", "llama_distopt_tp2_fully_trained",
                       "llama_distopt_vpp2_buckets_trained", "llama_fp16_trained",
                       "llama_legacy_adam_trained", "llama_legacy_bf16_tp2_pp2_trained",
                       "llama_legacy_distopt_bf16_tp2_trained",
                       "llama_legacy_distopt_dp2_trained",
                       "llama_lion_bf16_trained",
                       "llama_lion_distopt_dp2_trained", "llama_lion_trained",
                       "llama_sgd_trained",
                       "mixtral_distopt_ep2_buckets_trained",
                       "mixtral_legacy_distopt_ep2_trained", "mixtral_legacy_ep2_trained",
                       "mixtral_lion_ep2_trained", "mixtral_lion_trained", "mixtral_trained"]
    for name in TRAINED:
        ckpt = find_checkpoint(os.path.join(FIXTURES, name))
        assert ckpt.iteration == STEPS
        assert (ckpt.format == "legacy") == ("legacy" in name)
        if ckpt.format == "legacy":   # each rank's torch optimizer state, by index
            rank = "mp_rank_01_001" if "pp2" in name else "mp_rank_01" if "tp2" in name \
                else "mp_rank_00_001" if "ep2" in name else "mp_rank_00"
            saved = _rank_optimizer(name, rank)
            beside = os.path.join(FIXTURES, name, f"iter_{STEPS:07d}", rank,
                                  "distrib_optim.pt")
            assert os.path.exists(beside) == ("distopt" in name)
            if "distopt" in name:   # the state in distrib_optim.pt, the groups here
                flat = load_pickled(beside)
                if "mixtral" in name:   # chained: the dense and the expert optimizer's
                    # groups, and on ep rank 1 the experts' buffers alone (the dense
                    # ones are ep rank 0's, the first rank of their data-parallel group)
                    assert [set(p["optimizer"]) for p in saved] == [{"param_groups"}] * 2
                    assert len(flat) == 2 and flat[0] is None
                    flat = flat[1]
                else:
                    assert set(saved["optimizer"]) == {"param_groups"}
                (states,) = flat[0].values()   # {(param dtype, grad dtype): states}
                assert flat["buckets_coalesced"] and set(states) == {
                    "param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
                continue
            # a Mixtral's chained dense and expert optimizers: a list of the two
            parts = saved if "mixtral" in name else [saved]
            assert len(parts) == (2 if "mixtral" in name else 1)
            for part in parts:
                inner = part.get("optimizer", part)
                assert set(inner) == {"state", "param_groups"} and len(inner["state"]) > 1
                assert ("fp32_from_fp16_params" in part) == ("bf16" in name)
            continue
        keys = list(tensor_shapes(ckpt))
        flat = buckets.bucket_keys(keys)
        assert bool(flat) == ("buckets" in name)   # Megatron-LM's default: dp_reshardable
        names = {k.split("optimizer.state.")[1].split(".")[0] for k in keys
                 if "optimizer.state." in k}   # (a chained optimizer's prefix before it)
        names |= buckets.bucket_states(keys)
        assert names >= ({"momentum_buffer"} if "sgd" in name else {"exp_avg", "exp_avg_sq"})
        # the distributed optimizer's main weights (Megatron-Core 0.19.2 keeps a Lion run's
        # optimizers plain, --use-distributed-optimizer or not)
        assert ("param" in names) == ("distopt" in name and "lion" not in name)
    # several buckets per rank, and parameters padded to 64 elements within them
    sizes = {k: v[0].numel() for k, v in tensor_shapes(find_checkpoint(
        os.path.join(FIXTURES, "llama_distopt_buckets_trained"))).items() if k.endswith("param")}
    assert len(sizes) == 5 and any(n % 64 for n in sizes.values()) is False


def _rank_optimizer(name: str, rank: str) -> dict:
    """The optimizer entry of one rank file of legacy fixture ``name``."""
    path = os.path.join(FIXTURES, name, f"iter_{STEPS:07d}", rank, "model_optim_rng.pt")
    return load_pickled(path)["optimizer"]


@pytest.mark.parametrize("name", ["llama_adam_trained", "llama_distopt_dp2_trained",
                                  "llama_distopt_buckets_trained",
                                  "llama_distopt_tp2_buckets_trained",
                                  "llama_distopt_pp2_buckets_trained",
                                  "llama_distopt_vpp2_buckets_trained", "llama_sgd_trained",
                                  "llama_legacy_adam_trained", "mixtral_legacy_ep2_trained",
                                  "llama_legacy_distopt_dp2_trained",
                                  "mixtral_legacy_distopt_ep2_trained",
                                  "mixtral_trained", "mixtral_distopt_ep2_buckets_trained",
                                  "deepseek_v3_mtp_trained", "llama_lion_trained",
                                  "llama_lion_distopt_dp2_trained", "mixtral_lion_trained",
                                  "mixtral_lion_ep2_trained"])
def test_resumed_step_equals_megatrons_next_step(imported, name):
    root = imported[name]
    meta = read_metadata(iteration_dir(root, STEPS))
    assert meta["iteration"] == STEPS and meta["optimizer_state"] == (
        ["momentum_buffer"] if "sgd" in name else ["exp_avg", "exp_avg_sq"])
    result, weights, want, megatron, state = _next_step(root, name)
    dp = want["tokens"].shape[0]
    assert state[:3] == (STEPS, STEPS * 2 * dp, STEPS)   # iteration, samples (mbs 2), steps
    assert result.lr == pytest.approx(want["lr"], rel=1e-12) and result.lr < 1e-3  # decaying
    assert result.lm_loss == pytest.approx(want["loss"], abs=2e-6)
    if "mtp" in name:   # the depth's loss joined the step, and the expert biases moved
        assert "mtp_1_loss" in result.moe_losses
        moved = [k for k in megatron if k.endswith("expert_bias")]
        assert len(moved) == 2 and all(megatron[k].abs().max() > 0 for k in moved)
    assert {k for k in weights if not k.endswith("expert_bias")} <= megatron.keys() \
        <= weights.keys()   # Megatron's expert biases are buffers of its state dict
    worst = max((weights[k] - megatron[k]).abs().max().item() for k in megatron)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("name,main", [("llama_bf16_trained", "fp32_param"),
                                       ("llama_distopt_bf16_trained", "param"),
                                       ("llama_lion_bf16_trained", "fp32_param"),
                                       ("llama_fp16_trained", "fp32_param")])
def test_half_precision_run_resumes_with_its_fp32_main_weights(imported, name, main):
    """The masters are Megatron's fp32 main copies (not the bf16 / fp16 weights widened;
    the plain optimizer's ``fp32_param``, the distributed one's ``param``), an fp16 run's
    dynamic loss scale comes along (Megatron's ``grad_scaler``: 1024, two clean steps of
    its window of 3, the hysteresis untouched), and the resumed step lands within one
    bf16 rounding of Megatron's."""
    root = imported[name]
    ckpt = find_checkpoint(os.path.join(FIXTURES, name))
    shapes = tensor_shapes(ckpt)
    prefix = f"optimizer.state.{main}."
    keys = [k for k in shapes if k.startswith(prefix)]
    saved = read_tensors(ckpt, keys)
    chunks = {k[len(prefix):]: shapes[k][1] for k in keys}
    cfg, _ = checkpoint_config(root)
    fp16 = "fp16" in name
    assert (cfg.model.fp16 if fp16 else cfg.model.bf16) and keys
    half = torch.float16 if fp16 else torch.bfloat16
    if fp16:
        from megalite.checkpoint.consolidated import load_full_training_state

        scaler = load_full_training_state(root)[2]["loss_scaler"]
        assert (scaler["scale"], scaler["clean_steps"], scaler["hysteresis_left"],
                scaler["window"]) == (1024.0, 2, 2, 3)
    masters = mapping.to_megalite({k[len(prefix):]: v for k, v in saved.items()}, chunks,
                                  cfg.model)
    from megalite.checkpoint.consolidated import load_full_model

    _, model = load_full_model(root)
    stored = read_megatron(os.path.join(FIXTURES, name)).optimizer.params
    widened = 0
    for key, master in masters.items():
        assert torch.equal(stored[key]["master"], master), key
        widened += not torch.equal(master, model.full_state_dict()[key].to(half).float())
    assert widened == len(masters)   # every master carries bits its half weight lacks
    before = model.full_state_dict()
    result, weights, want, megatron, state = _next_step(root, name)
    if fp16:   # the scale doubled at the window's third clean step, as Megatron's did
        after = want["grad_scaler"]
        assert (state[3]["scale"], state[3]["clean_steps"], state[3]["hysteresis_left"]) \
            == (after["scale"], after["growth_tracker"], after["hysteresis_tracker"]) \
            == (2048.0, 0, 2)
    assert result.lr == pytest.approx(want["lr"], rel=1e-12)
    # bf16 products round otherwise here than in Megatron: the loss agrees to 1.6e-4
    # relative, the weights to 8e-4 relative, and each update points the same way (cosine
    # 0.996 or more; a norm's update is below bf16's resolution in both). Lion turns the
    # gradient elements that rounding leaves near 0 into whole steps of lr either way: up
    # to 0.54% of a weight's elements 2 lr apart (seen), 2.8e-3 relative, cosine 0.989
    lion = "lion" in name
    assert result.lm_loss == pytest.approx(want["loss"], rel=1e-3)
    for key, w in megatron.items():
        ours, theirs = weights[key].float(), w.float()
        assert (ours - theirs).norm() <= (5e-3 if lion else 1e-3) * theirs.norm(), key
        if lion:
            assert ((ours - theirs).abs() > 1e-3).float().mean() <= 0.01, key
        a, b = (ours - before[key]).flatten(), (theirs - before[key]).flatten()
        if b.norm() > 0:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= (
                0.98 if lion else 0.99), key


@pytest.mark.parametrize("name", ["llama_legacy_bf16_tp2_pp2_trained",
                                  "llama_legacy_distopt_bf16_tp2_trained"])
def test_legacy_bf16_run_resumes_with_its_rank_files_state(imported, name):
    """Legacy (``--ckpt-format torch``) bf16 runs: at tp 2 x pp 2 each rank's Adam state,
    kept by parameter index, and its fp32 main weights (``fp32_from_fp16_params``); at tp
    2 x dp 2 the distributed optimizer's flat buffers (``distrib_optim.pt``, several
    buckets coalesced). Each is placed by name, merged over the ranks like the weights,
    and the step resumes within bf16's rounding of Megatron's (the bounds of
    test_half_precision_run_resumes_with_its_fp32_main_weights)."""
    root = imported[name]
    meta = read_metadata(iteration_dir(root, STEPS))
    assert meta["optimizer_state"] == ["exp_avg", "exp_avg_sq", "master"]
    stored = read_megatron(os.path.join(FIXTURES, name)).optimizer.params
    if "pp2" in name:
        # tp rank 1 of the last stage: its first weight-decayed parameter (the first
        # group's first) is its half of the columns of layer 1's output projection
        saved = _rank_optimizer(name, "mp_rank_01_001")
        proj = stored["decoder.layers.1.self_attention.linear_proj.weight"]
        first = saved["fp32_from_fp16_params"][0][0]
        assert torch.equal(proj["master"][:, 16:], first)
        assert torch.equal(proj["exp_avg"][:, 16:], saved["optimizer"]["state"][0]["exp_avg"])
    from megalite.checkpoint.consolidated import load_full_model

    _, model = load_full_model(root)
    before = model.full_state_dict()
    for key, entry in stored.items():   # the masters carry bits the bf16 weights lack
        assert torch.equal(entry["master"].to(torch.bfloat16).float(), before[key].float())
    assert sum(not torch.equal(e["master"], before[k].float()) for k, e in stored.items()) \
        == len(stored)
    result, weights, want, megatron, state = _next_step(root, name)
    assert state[:3] == (STEPS, STEPS * 2 * want["tokens"].shape[0], STEPS)
    assert result.lr == pytest.approx(want["lr"], rel=1e-12)
    assert result.lm_loss == pytest.approx(want["loss"], rel=1e-3)
    for key, w in megatron.items():
        ours, theirs = weights[key].float(), w.float()
        assert (ours - theirs).norm() <= 1e-3 * theirs.norm(), key
        a, b = (ours - before[key]).flatten(), (theirs - before[key]).flatten()
        if b.norm() > 0:
            assert torch.nn.functional.cosine_similarity(a, b, dim=0) >= 0.99, key


def test_misplaced_optimizer_state_is_not_imported(tmp_path, capsys):
    """Megatron-Core 0.19.2's --dist-ckpt-optim-fully-reshardable at tp 2 with several
    buckets writes its optimizer state misplaced: the same run saved in the default format
    (``llama_distopt_tp2_buckets_trained``) has the same weights, but here most main
    parameters differ from them (and the moments from that run's). The import keeps the
    weights, drops the state with one note naming the first misplaced parameter, and the
    result continues with --finetune."""
    name = "llama_distopt_tp2_fully_trained"
    got = read_megatron(os.path.join(FIXTURES, name))
    twin = read_megatron(os.path.join(FIXTURES, "llama_distopt_tp2_buckets_trained"))
    assert got.optimizer is None and twin.optimizer is not None
    assert got.state.keys() == twin.state.keys()
    assert all(torch.equal(got.state[k], twin.state[k]) for k in got.state)
    (note,) = got.notes
    assert note.startswith("the optimizer state is not imported: its main parameters are "
                           "not the saved weights (embedding.word_embeddings.weight")
    assert "of 15 parameters" in note and "--finetune" in note
    save = str(tmp_path / "weights")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.join(FIXTURES, name), "--save-dir", save) == 0
    assert "main parameters are not the saved weights" in capsys.readouterr().out
    assert read_metadata(iteration_dir(save, 0))["optimizer_state"] is None


@pytest.mark.parametrize("name", ["llama_adam_trained", "llama_legacy_distopt_dp2_trained"])
def test_no_load_optim_imports_the_weights_alone(tmp_path, capsys, monkeypatch, name):
    from megalite.checkpoint.megatron import legacy_optimizer

    def unread(*args, **kwargs):   # (legacy files: their optimizer state is not even placed)
        raise AssertionError("the optimizer state was read")

    monkeypatch.setattr(legacy_optimizer, "rank_states", unread)
    save = str(tmp_path / "weights")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.join(FIXTURES, name), "--save-dir", save,
                   "--no-load-optim") == 0
    out = capsys.readouterr().out
    assert "note: the optimizer state is not imported (--no-load-optim)" in out
    assert "--finetune" in out
    meta = read_metadata(iteration_dir(save, 0))
    assert meta["iteration"] == 0 and meta["optimizer_state"] is None


def test_unread_distributed_optimizer_format_imports_the_weights_with_a_note(tmp_path, capsys):
    """A distributed-optimizer format megalite does not read (fully_sharded_model_space:
    flattened slices) imports the weights, and a note says how to re-save."""
    root = tmp_path / "flat"
    shutil.copytree(os.path.join(FIXTURES, "llama_distopt_dp2_trained"), root)
    ckpt = find_checkpoint(str(root))
    common = read_common(ckpt)
    common["args"] = argparse.Namespace(**{k: v for k, v in vars(common["args"]).items()
                                           if not isinstance(v, _Opaque)})
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_sharded_model_space"
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(common, os.path.join(ckpt.directory, "common.pt"))
    save = str(tmp_path / "out")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir", str(root),
                   "--save-dir", save) == 0
    out = capsys.readouterr().out
    assert "saved as 'fully_sharded_model_space'" in out
    assert "--dist-ckpt-optim-fully-reshardable" in out
    assert read_metadata(iteration_dir(save, 0))["optimizer_state"] is None


def _edited_legacy(tmp_path, edit) -> str:
    """A copy of ``llama_legacy_adam_trained`` whose one rank file ``edit(state)`` changed
    (its args without the values only Megatron can unpickle)."""
    root = tmp_path / "legacy"
    shutil.copytree(os.path.join(FIXTURES, "llama_legacy_adam_trained"), root)
    path = root / f"iter_{STEPS:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_pickled(str(path))
    state["args"] = argparse.Namespace(**{k: v for k, v in vars(state["args"]).items()
                                          if not isinstance(v, _Opaque)})
    edit(state)
    torch.save(state, path)
    return str(root)


@pytest.mark.parametrize("case", ["distributed", "miscounted"])
def test_legacy_optimizer_state_that_cannot_be_placed_imports_the_weights(tmp_path, capsys,
                                                                          case):
    """A legacy file whose optimizer state megalite cannot place by name (a distributed
    optimizer's without its distrib_optim.pt; a parameter group that does not count the
    rank's weights) imports the weights with one note saying why."""
    def edit(state):
        if case == "distributed":
            state["args"].use_distributed_optimizer = True
        else:   # the no-weight-decay group loses its last parameter
            index = state["optimizer"]["param_groups"][1]["params"].pop()
            del state["optimizer"]["state"][index]

    root = _edited_legacy(tmp_path, edit)
    save = str(tmp_path / "out")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir", root,
                   "--save-dir", save) == 0
    out = capsys.readouterr().out
    why = ("its distributed optimizer's distrib_optim.pt files are missing" if
           case == "distributed" else
           "its parameter group 1 holds 4 parameters where the rank's weights give 5")
    assert f"the optimizer state is not imported ({why}" in out, out
    assert read_metadata(iteration_dir(save, 0))["optimizer_state"] is None
    got = read_megatron(root).state
    want = read_megatron(os.path.join(FIXTURES, "llama_legacy_adam_trained")).state
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def _bucket_inputs(name: str):
    """(flat bucket tensors, trained weights, chunks) of fixture ``name``."""
    ckpt = find_checkpoint(os.path.join(FIXTURES, name))
    shapes = tensor_shapes(ckpt)
    weights = [k for k in shapes if mapping.is_model_key(k)]
    return (read_tensors(ckpt, buckets.bucket_keys(shapes)), read_tensors(ckpt, weights),
            {k: v[1] for k, v in shapes.items()})


def test_bucket_state_places_every_weight_piece_once():
    """The tp 2 fixture's four ranks' buckets: each weight's saved pieces (fc1's gate and
    up halves apart) found once, at positions padded to 64 elements, the fp32 main
    weights equal to the saved weights."""
    flat, weights, chunks = _bucket_inputs("llama_distopt_tp2_buckets_trained")
    assert len({k.split(".")[2] for k in flat}) == 2   # dp_group_idx: one per tp rank
    states = buckets.read_bucket_state(flat, weights, chunks, "fixture")
    assert set(states) == {"param", "exp_avg", "exp_avg_sq"}
    assert set(states["param"]) == set(weights)
    for key, w in weights.items():
        assert torch.equal(states["param"][key], w.float()), key
        assert states["exp_avg_sq"][key].min() >= 0 and states["exp_avg"][key].abs().max() > 0


def test_bucket_state_of_many_unaligned_weights_is_placed_exactly():
    """A synthetic bucket layout as Megatron builds it: 96 pieces of sizes that are not
    multiples of 64 (each parameter then padded to 64 elements, the gaps NaN), the
    registration order reversed, buckets of about 20,000 elements: every state lands on
    its own weight."""
    g = torch.Generator().manual_seed(0)
    weights = {f"decoder.layers.t{k}.weight": torch.randn(12, 500 + 37 * k, generator=g)
               for k in range(8)}
    chunks = {k: [((layer, 0), (1, w.shape[1])) for layer in range(12)]
              for k, w in weights.items()}
    order = [(k, layer) for layer in range(12) for k in sorted(weights)][::-1]
    flat, parts, size, index = {}, [], 0, 0
    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, " \
        "torch.float32).bucket_idx_"

    def close():
        t = torch.cat(parts)
        flat[f"{prefix}{index}.param"], flat[f"{prefix}{index}.exp_avg"] = t, 2 * t

    for key, layer in order:
        if size % buckets.ALIGN:
            parts.append(torch.full((-size % buckets.ALIGN,), float("nan")))
            size += parts[-1].numel()
        parts.append(weights[key][layer])
        size += parts[-1].numel()
        if size >= 20_000:
            close()
            parts, size, index = [], 0, index + 1
    close()
    assert index == 3   # four buckets
    states = buckets.read_bucket_state(flat, weights, chunks, "synthetic")
    for key, w in weights.items():
        assert torch.equal(states["param"][key], w) and torch.equal(states["exp_avg"][key],
                                                                     2 * w), key


def test_bucket_state_that_matches_no_weight_is_refused():
    """Bucket buffers that are not the weights' (one main weight changed, or a bucket
    missing) give one error naming --no-load-optim and the re-save flag."""
    from megalite.checkpoint.files import CheckpointError

    flat, weights, chunks = _bucket_inputs("llama_distopt_buckets_trained")
    changed = dict(flat)
    key = next(k for k in flat if k.endswith("bucket_idx_1.param"))
    changed[key] = flat[key].clone()
    changed[key][2100] += 1.0   # in its second weight (2048 elements each)
    with pytest.raises(CheckpointError, match=r"bucket_idx_1\).*element 2048 match no saved "
                                              r"weight.*--no-load-optim.*fully-reshardable"):
        buckets.read_bucket_state(changed, weights, chunks, "fixture")
    fewer = {k: v for k, v in flat.items() if ".bucket_idx_1." not in k}
    with pytest.raises(CheckpointError, match="buckets hold no state for decoder.layers"):
        buckets.read_bucket_state(fewer, weights, chunks, "fixture")


@pytest.mark.parametrize("name,layout", [
    ("llama_distopt_dp2_trained", []), ("deepseek_v3_mtp_trained", []),
    ("llama_distopt_dp2_trained", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("llama_distopt_tp2_buckets_trained", ["--sequence-parallel"]),
    ("llama_lion_trained", []),
    ("mixtral_distopt_ep2_buckets_trained", ["--expert-model-parallel-size", "2"]),
], ids=["llama", "deepseek-v3-mtp", "llama-at-tp2-sp", "llama-tp2-buckets-at-tp2-sp",
        "llama-lion", "mixtral-at-ep2"])
def test_pretrain_resumes_an_import_where_megatron_stopped(tmp_path, capsys, name, layout):
    """The whole move: the Megatron run's own flags verbatim (``fixture.json``), its data
    (the same corpus, seed and split), ``--load`` of the import and ``--no-load-rng``:
    megalite's iteration 3 is Megatron's, the same samples (from the consumed-sample
    count), learning rate and loss, in one process or at another layout (two ranks,
    tp 2 + sp, where Megatron ran at dp 2)."""
    import json
    import subprocess

    from tests.checkpoint.megatron.trained import small_vocab_corpus
    from tests.training.common import (
        ENTRYPOINT,
        PYTHON,
        read_jsonl,
        start_two_ranks,
        subprocess_env,
    )

    save = str(tmp_path / "imported")
    assert convert("--source", "megatron", "--target", "megalite", "--load-dir",
                   os.path.join(FIXTURES, name), "--save-dir", save) == 0
    with open(os.path.join(FIXTURES, name, "fixture.json")) as f:
        made = json.load(f)
    gbs = 2 * made["dp"]
    printed = capsys.readouterr().out
    assert "--no-load-rng, without --finetune" in printed
    assert f"(sample {STEPS * gbs})" in printed
    assert "add --per-microbatch-loss" in printed   # Megatron's default normalisation
    flags = made["flags"] + ["--per-microbatch-loss"]
    corpus = small_vocab_corpus(str(tmp_path / "corpus"))
    argv = [*flags, *layout, "--global-batch-size", str(gbs), "--data-path", corpus,
            "--load", save, "--no-load-rng", "--save", str(tmp_path / "ck"),
            "--exit-interval", "3", "--eval-iters", "0", "--log-interval", "1",
            "--metrics-jsonl", str(tmp_path / "m.jsonl")]
    if layout:
        ranks = start_two_ranks(argv)
        outs = [r.communicate(timeout=300) for r in ranks]
        assert all(r.returncode == 0 for r in ranks), [e[-3000:] for _, e in outs]
        stdout = "".join(o for o, _ in outs)
    else:
        proc = subprocess.run([PYTHON, ENTRYPOINT, *argv], env=subprocess_env(),
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    assert (f"loaded {save}/iter_0000002 (iteration 2, {STEPS * gbs} samples consumed)"
            in stdout)
    assert f"consumed samples: {3 * gbs:12d}" in stdout
    # Megatron's Lion took the Adam betas; the verbatim flags' --lion-beta2 0.99 is named
    assert ("its Lion ran with betas (0.9, 0.95); this run's --lion-beta1/2 give (0.9, 0.99)"
            in stdout) == ("lion" in name)
    (row,) = read_jsonl(str(tmp_path / "m.jsonl"))
    want = torch.load(os.path.join(FIXTURES, name, "next_step.pt"))
    assert row["iteration"] == 3 and row["lr"] == pytest.approx(want["lr"], rel=1e-9)
    assert row["lm_loss"] == pytest.approx(want["loss"], abs=2e-6)
    assert os.path.exists(tmp_path / "ck" / "iter_0000003")
    if "mixtral" in name:   # megalite's run at ep 2 exports for a Megatron run at ep 2
        capsys.readouterr()
        out = str(tmp_path / "megatron")
        assert convert("--source", "megalite", "--target", "megatron", "--load-dir",
                       str(tmp_path / "ck"), "--save-dir", out,
                       "--transformer-impl", "local") == 0
        assert ", at --expert-model-parallel-size 2:" in capsys.readouterr().out
        assert sorted(read_common(find_checkpoint(out))["optimizer"]) == [0, 1]
