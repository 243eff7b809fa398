"""Where shards sit in the global tensors: fused parts, vocabulary padding, experts; and
resharding across expert-parallel sizes (Mixtral) and across pipeline stages and virtual
chunks (tied output layer included)."""

import os
import shutil

import pytest
import torch

from megalite.checkpoint.files import CheckpointError
from megalite.checkpoint.layout import (
    ParamLayout,
    Piece,
    param_pieces,
    read_fused_whole_where_saved_so,
)
from megalite.layers.sharding import mark_param
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config


def _param(shape, **marks):
    return mark_param(torch.nn.Parameter(torch.zeros(shape)), init_std=1.0, **marks)


def test_fused_parts_are_separate_global_tensors():
    qkv = _param((12, 4), partition_dim=0, parts=(8, 8, 8))   # tp rank 1 of 2
    pieces = param_pieces("qkv", qkv, tp_size=2, tp_rank=1)
    assert pieces == [Piece(f"qkv/part{i}", (8, 4), (4, 0), (4, 4), 0, 4 * i)
                      for i in range(3)]
    local = torch.arange(48.0).reshape(12, 4)
    assert torch.equal(pieces[2].view(local), local[8:12])


def test_vocab_padding_rows_are_not_saved():
    # vocab 61 padded to 64 over tp=4: 16 rows per rank, the last rank holds 13 real rows
    emb = _param((16, 8), partition_dim=0, unpadded_size=61)
    assert param_pieces("e", emb, 4, 3) == [Piece("e", (61, 8), (48, 0), (13, 8), 0, 0)]
    emb = _param((4, 8), partition_dim=0, unpadded_size=9)  # padded to 16 over tp=4
    assert param_pieces("e", emb, 4, 3) == []                # all padding: nothing to save


def test_experts_stack_over_expert_parallel_ranks():
    fc1 = _param((2, 8, 6), partition_dim=2, parts=(6, 6))   # ep rank 1 of 2, etp rank 0
    assert param_pieces("fc1", fc1, 2, 0, ep_size=2, ep_rank=1) == [
        Piece("fc1/part0", (4, 8, 6), (2, 0, 0), (2, 8, 3), 2, 0),
        Piece("fc1/part1", (4, 8, 6), (2, 0, 0), (2, 8, 3), 2, 3)]


MIXTRAL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
           "group_query_attention": True, "num_query_groups": 4, "ffn_hidden_size": 96,
           "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
           "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
           "num_experts": 4, "moe_router_topk": 2}


def _mixtral_ep2(rank, world_size, save):
    cfg = tiny_config(world_size, model=MIXTRAL, parallel={"expert_model_parallel_size": 2},
                      train={"train_iters": 4}, checkpoint={"save": save, "save_interval": 2})
    return run_training(cfg)[0].losses


def test_mixtral_at_ep2_resumes_at_ep1(tmp_path):
    save, load = str(tmp_path / "ep2"), tmp_path / "ep1"
    straight = run_distributed(2, _mixtral_ep2, save)[-1]
    load.mkdir()
    shutil.copytree(os.path.join(save, "iter_0000002"), load / "iter_0000002")
    (load / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed, _ = run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4},
                                          checkpoint={"save": str(load), "load": str(load)}))
    assert list(resumed.losses) == [3, 4]
    for it in (3, 4):
        assert resumed.losses[it] == pytest.approx(straight[it], rel=2e-6)


GPT_4_LAYERS = {"num_layers": 4}   # tied embeddings: pp > 1 holds an output-layer copy


def _pipeline_body(rank, world_size, load):
    par = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    cfg = tiny_config(world_size, model=GPT_4_LAYERS, parallel=par, train={"train_iters": 4},
                      checkpoint={"load": load, "save": load})
    result, _ = run_training(cfg)
    return result.losses


def test_pp1_checkpoint_resumes_at_pp2_with_virtual_chunks(tmp_path):
    save = str(tmp_path / "ckpt")
    straight, _ = run_training(tiny_config(model=GPT_4_LAYERS, train={"train_iters": 4}))
    run_training(tiny_config(model=GPT_4_LAYERS, train={"train_iters": 4, "exit_interval": 2},
                             checkpoint={"save": save}))
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    resumed = run_distributed(2, _pipeline_body, save)[-1]
    assert list(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(straight.losses[it], rel=2e-6)


def _mixtral_tp2(rank, world_size, load):
    cfg = tiny_config(world_size, model=MIXTRAL, parallel={"tensor_model_parallel_size": 2},
                      train={"train_iters": 4}, checkpoint={"load": load, "save": load})
    assert cfg.parallel.expert_tensor_parallel_size == 2
    return run_training(cfg)[0].losses


def test_mixtral_at_etp1_resumes_at_etp2(tmp_path):
    """Expert fc1 (SwiGLU gate|up) is stored part by part at etp = 1 too, so an etp-1
    checkpoint loads with the experts split over etp = 2 (and back, for conversion)."""
    save = str(tmp_path / "etp1")
    straight, _ = run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4}))
    run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4, "exit_interval": 2},
                             checkpoint={"save": save}))
    resumed = run_distributed(2, _mixtral_tp2, save)[-1]
    assert list(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it] == pytest.approx(straight.losses[it], rel=2e-6)


def test_expert_fc1_saved_whole_by_older_versions_still_loads(tmp_path, monkeypatch):
    """Before expert weights were marked sharded at etp = 1, fc1 was one global tensor
    ``...experts.fc1`` (gate|up concatenated): such a checkpoint resumes the same."""
    from megalite.moe import experts

    real = experts.mark_param

    def whole(param, *, partition_dim=-1, parts=None, **kw):   # the old marking
        return real(param, **kw)

    save = str(tmp_path / "old")
    straight, _ = run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4}))
    monkeypatch.setattr(experts, "mark_param", whole)
    run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4, "exit_interval": 2},
                             checkpoint={"save": save}))
    monkeypatch.undo()
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(os.path.join(save, "iter_0000002")).read_metadata()
    keys = keys.state_dict_metadata
    assert "model/decoder.layers.0.mlp.experts.fc1" in keys
    assert "model/decoder.layers.0.mlp.experts.fc1/part0" not in keys
    resumed, _ = run_training(tiny_config(model=MIXTRAL, train={"train_iters": 4},
                                          checkpoint={"load": save, "save": save}))
    assert list(resumed.losses) == [3, 4]
    for it in (3, 4):
        assert resumed.losses[it] == pytest.approx(straight.losses[it], rel=2e-6)


def _fc1_layout(etp):
    fc1 = _param((2, 8, 12 // etp), partition_dim=2, parts=(6, 6), expert=True)
    pieces = param_pieces("fc1", fc1, etp, 0)
    return ParamLayout("fc1", "fc1", "fc1", fc1, pieces, (2, 8, 12))


def test_a_whole_fused_tensor_is_read_as_one_block_only_unsplit():
    layout = _fc1_layout(1)
    read_fused_whole_where_saved_so([layout], {"fc1": (2, 8, 12)})
    assert layout.pieces == [Piece("fc1", (2, 8, 12), (0, 0, 0), (2, 8, 12))]
    untouched = _fc1_layout(1)
    read_fused_whole_where_saved_so([untouched], {"fc1/part0": (2, 8, 6),
                                                  "fc1/part1": (2, 8, 6)})
    assert [p.key for p in untouched.pieces] == ["fc1/part0", "fc1/part1"]
    with pytest.raises(CheckpointError, match="--expert-tensor-parallel-size 1"):
        read_fused_whole_where_saved_so([_fc1_layout(2)], {"fc1": (2, 8, 12)})
