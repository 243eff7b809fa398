"""On-disk format, crash safety, integrity checks and what ``--load`` means, in one
process."""

import json
import os

import pytest
import torch

import megalite.checkpoint.save as ckpt_save
from megalite.checkpoint import CheckpointError, load_checkpoint, read_latest_iteration
from megalite.checkpoint.layout import EMBEDDING_WEIGHT
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components, default_model_provider
from tests.training.common import run_training, tiny_config


def _build(cfg):
    return build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 iterations with checkpoints at 2 and 4 (checksums on); the components."""
    save = str(tmp_path_factory.mktemp("fmt") / "ckpt")
    cfg = tiny_config(train={"train_iters": 4},
                      checkpoint={"save": save, "save_interval": 2, "ckpt_verify": True})
    _, components = run_training(cfg)
    return save, components


def _iter4(save):
    return os.path.join(save, "iter_0000004")


def test_layout_metadata_and_manifest(trained):
    save, _ = trained
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]
    assert read_latest_iteration(save) == 4
    assert sorted(os.listdir(_iter4(save))) == [".metadata", "__0_0.distcp", "metadata.json"]
    with open(os.path.join(_iter4(save), "metadata.json")) as f:
        meta = json.load(f)
    assert meta["format"] == "megalite-dcp-v1"
    assert (meta["iteration"], meta["consumed_samples"]) == (4, 32)
    assert meta["layout"]["tp"] == 1 and meta["config"]["model"]["hidden_size"] == 32
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"}
    for name, entry in meta["files"].items():
        path = os.path.join(_iter4(save), name)
        assert entry["bytes"] == os.path.getsize(path) and len(entry["sha256"]) == 64


def test_global_keys_are_layout_free(trained):
    import torch.distributed.checkpoint as dcp

    save, _ = trained
    keys = dcp.FileSystemReader(_iter4(save)).read_metadata().state_dict_metadata
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert {f"model/{qkv}/part{i}" for i in range(3)} <= set(keys)
    assert tuple(keys[f"model/{EMBEDDING_WEIGHT}"].size) == (61, 32)   # unpadded vocab
    assert f"optim/exp_avg/{qkv}/part1" in keys and "rng/00000" in keys and "common" in keys


def test_round_trip_restores_weights_optimizer_and_schedule(trained):
    save, done = trained
    c = _build(tiny_config(checkpoint={"load": save}))
    assert (c.state.iteration, c.state.consumed_train_samples) == (4, 32)
    assert c.scheduler.num_steps == 4
    for (name, p), q in zip(c.model.named_parameters(), done.model.parameters()):
        assert torch.equal(p, q), name
    got, want = c.optimizer.state_dict_per_param(), done.optimizer.state_dict_per_param()
    assert got["step"] == want["step"] == 4
    for name, entry in want["params"].items():
        for key, value in entry.items():
            assert torch.equal(got["params"][name][key], value), (name, key)
    c.close()


def test_finetune_and_no_load_optim(trained):
    save, done = trained
    c = _build(tiny_config(checkpoint={"load": save, "finetune": True}))
    assert c.state.iteration == 0 and c.scheduler.num_steps == 0
    assert c.optimizer.state_dict_per_param()["step"] == 0
    assert torch.equal(next(c.model.parameters()), next(done.model.parameters()))
    c.close()
    c = _build(tiny_config(checkpoint={"load": save, "no_load_optim": True,
                                       "no_load_rng": True}))
    assert c.state.iteration == 4 and c.optimizer.state_dict_per_param()["step"] == 0
    c.close()


def test_load_rules_for_directories_without_checkpoint(tmp_path, trained):
    empty = str(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="directory does not exist.*expects a "
                                              "checkpoint"):
        _build(tiny_config(checkpoint={"load": empty}))
    # the launcher idiom --load D --save D starts fresh on an empty D
    assert _build(tiny_config(checkpoint={"load": empty, "save": empty})).state.iteration == 0
    with pytest.raises(CheckpointError, match="--finetune needs weights"):
        _build(tiny_config(checkpoint={"load": empty, "save": empty, "finetune": True}))
    # iteration directories without a latest pointer: never a silent fresh start
    save, _ = trained
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    os.symlink(_iter4(save), orphan / "iter_0000004")
    with pytest.raises(CheckpointError, match="iter_0000004 .* but no latest_checkpointed"):
        _build(tiny_config(checkpoint={"load": str(orphan), "save": str(orphan)}))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="Hugging Face model: convert it"):
        _build(tiny_config(checkpoint={"load": str(hf)}))


def _copy_checkpoint(save, dst):
    import shutil

    shutil.copytree(save, dst, symlinks=False)
    return str(dst)


def test_missing_truncated_and_damaged_files_are_named(tmp_path, trained):
    save = _copy_checkpoint(trained[0], tmp_path / "ck")
    data = os.path.join(_iter4(save), "__0_0.distcp")
    with open(data, "r+b") as f:                   # same size, one byte flipped
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is damaged: its sha256"):
        _build(tiny_config(checkpoint={"load": save, "ckpt_verify": True}))
    with open(data, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is damaged: 1000 bytes.*"
                                              "truncated"):
        _build(tiny_config(checkpoint={"load": save}))
    os.remove(data)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        _build(tiny_config(checkpoint={"load": save}))
    os.remove(os.path.join(_iter4(save), "metadata.json"))
    with pytest.raises(CheckpointError, match="metadata.json is missing: .* not a megalite "
                                              "checkpoint"):
        _build(tiny_config(checkpoint={"load": save}))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("garbage")
    with pytest.raises(CheckpointError, match="should hold an iteration number"):
        _build(tiny_config(checkpoint={"load": save}))


def test_shape_mismatch_names_first_tensor(trained):
    save, _ = trained
    cfg = tiny_config(model={"ffn_hidden_size": 64})
    cfg.model.vocab_size = 61  # as the NullTokenizer sets it
    ps = ParallelState.build(cfg.parallel)
    model = default_model_provider(cfg, ps)
    with pytest.raises(CheckpointError, match=r"tensor 'decoder\.layers\.0\.mlp\.linear_fc1"
                                              r"\.weight' has shape \(128, 32\) in checkpoint "
                                              r".* but \(64, 32\) in the model"):
        load_checkpoint(save, model, None, None, ps)
    cfg = tiny_config(model={"num_layers": 1})
    cfg.model.vocab_size = 61
    with pytest.raises(CheckpointError, match="has tensor 'decoder.layers.1.*' that the model "
                                              "does not have"):
        load_checkpoint(save, default_model_provider(cfg, ps), None, None, ps)


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_dir = str(tmp_path / "ckpt")
    real_write = ckpt_save.write_blocks
    calls = []

    def crash_on_second_save(state, pieces, directory, group, no_dist):
        calls.append(directory)
        if len(calls) == 2:
            with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full (injected)")
        real_write(state, pieces, directory, group, no_dist)

    monkeypatch.setattr(ckpt_save, "write_blocks", crash_on_second_save)
    cfg = tiny_config(train={"train_iters": 6}, checkpoint={"save": save_dir,
                                                            "save_interval": 2})
    with pytest.raises(CheckpointError, match="saving iteration 4 .* failed .*disk full"):
        run_training(cfg)
    assert read_latest_iteration(save_dir) == 2
    assert sorted(os.listdir(save_dir)) == ["iter_0000002",      # the partial one removed
                                            "latest_checkpointed_iteration.txt"]
    monkeypatch.setattr(ckpt_save, "write_blocks", real_write)
    result, _ = run_training(tiny_config(train={"train_iters": 6}, checkpoint={
        "save": save_dir, "load": save_dir, "save_interval": 2}))
    assert result.iteration == 6 and read_latest_iteration(save_dir) == 6
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                            "latest_checkpointed_iteration.txt"]
