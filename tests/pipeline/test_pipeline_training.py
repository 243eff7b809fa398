"""Layout equivalence of pipeline parallelism: pp x virtual x tp x dp x SP.

Each layout (the ``pipeline`` rows of ``tests/layouts.py``) trains the same tiny GPT (8
layers, tied embeddings, fp32, dropout 0) for 6 iterations; its per-iteration loss must
match the single-process run, and the final word embedding (first stage) and its tied copy
in the output layer (last stage) must match the single-process embedding -- so the tied
gradients were summed over the embedding group.
"""

import dataclasses
import os

import pytest
import torch

from megalite.pipeline.layout import model_chunks
from megalite.pipeline.p2p import WAIT_SENDS_ENV
from tests.distributed.harness import run_distributed
from tests.layouts import Layout, by_name, layouts, run_by_world, tiny
from tests.training.common import run_training

ITERS = 6
LOSS_TOL = 2e-5
PARAM_TOL = 5e-5
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYOUTS = layouts("pipeline")   # 8 layers, micro-batch 1, global batch 8


def _cfg(layout):
    return tiny(layout, train={"train_iters": ITERS})


def _train(rank, world_size, layouts):
    out = []
    for layout in layouts:
        result, c = run_training(_cfg(layout))
        tensors = {}
        for chunk in model_chunks(c.model):
            full = chunk.full_state_dict()  # collective over tp
            for name in (EMBEDDING, OUTPUT):
                if name in full:
                    tensors[name] = full[name]
        out.append((result.losses, tensors))
    return out


def _math(model: dict) -> dict:
    """The model settings that change the arithmetic (recomputation does not)."""
    return {k: v for k, v in model.items() if not k.startswith("recompute")}


@pytest.fixture(scope="module")
def reference():
    """The single-process run of the same model (every row shares it)."""
    model, train = LAYOUTS[0].model, LAYOUTS[0].train
    assert all(_math(r.model) == model and r.train == train for r in LAYOUTS)
    result, c = run_training(_cfg(Layout("reference", 1, model=model, train=train)))
    assert len(result.losses) == ITERS and result.losses[ITERS] < result.losses[1]
    return result.losses, c.model.full_state_dict()[EMBEDDING]


@pytest.fixture(scope="module")
def trained():
    return run_by_world(LAYOUTS, _train)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout, reference, trained):
    ref_losses, ref_embedding = reference
    results = trained(layout)
    for losses, tensors in results:
        for it in ref_losses:
            assert abs(losses[it] - ref_losses[it]) < LOSS_TOL, (layout.name, it, losses[it],
                                                                  ref_losses[it])
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, ref_embedding, rtol=0, atol=PARAM_TOL,
                                       msg=lambda m, name=name: f"{layout} {name}: {m}")
    names = {name for _, tensors in results for name in tensors}
    assert EMBEDDING in names and OUTPUT in names  # both copies were checked


def _nccl_like(name, **parallel):
    """Row ``name`` again, with ``parallel`` overrides; run with every batch of transfers
    waiting for its sends too (see ``megalite.pipeline.p2p``)."""
    lay = by_name(name)
    suffix = "-varseq" if parallel else ""
    return dataclasses.replace(lay, name=f"{lay.name}-nccl{suffix}",
                               parallel={**lay.parallel, **parallel}), lay


NCCL_LIKE = [_nccl_like(name) for name in ("pipeline-pp2", "pipeline-pp2-vpp2",
                                           "pipeline-pp4-vpp2", "pipeline-tp2-sp-pp2-vpp2",
                                           "pipeline-pp2-zb_h1", "pipeline-pp2-zbv",
                                           "pipeline-pp4-zbv", "pipeline-pp4-dualpipev")]
NCCL_LIKE += [_nccl_like(name, variable_seq_lengths=True)
              for name in ("pipeline-pp2", "pipeline-pp2-vpp2")]


def _train_nccl_like(rank, world_size, layouts):
    os.environ[WAIT_SENDS_ENV] = "1"
    return [run_training(_cfg(layout))[0].losses for layout in layouts]


@pytest.fixture(scope="module")
def trained_nccl_like():
    return run_by_world([lay for lay, _ in NCCL_LIKE], _train_nccl_like)


@pytest.mark.parametrize("layout, base", NCCL_LIKE, ids=[str(lay) for lay, _ in NCCL_LIKE])
def test_nccl_semantics_give_the_same_losses(layout, base, trained, trained_nccl_like):
    """Transfers matched by order alone (no op has a tag), each batch completing as a
    whole as under NCCL, and with the shape handshake: bitwise the row's losses."""
    got = trained_nccl_like(layout)
    want = [losses for losses, _ in trained(base)]
    assert len(got[-1]) == ITERS and got == want, (layout.name, got[-1], want[-1])


DROPOUT = {"hidden_dropout": 0.2, "attention_dropout": 0.1}
RESUME = by_name("resume-pp2-vpp2")   # 4 layers, micro-batch 1, global batch 4


def _resume_body(rank, world_size, lay, save, resume):
    """Dropout on: the RNG tracker shared by a rank's chunks is checkpointed too."""
    straight, _ = run_training(tiny(lay, model=DROPOUT, train={"train_iters": 6},
                                    checkpoint={"save": save, "save_interval": 3}))
    if rank == 0:  # keep only the iteration-3 checkpoint for the resumed run
        import shutil
        shutil.copytree(f"{save}/iter_0000003", f"{resume}/iter_0000003")
        with open(f"{resume}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("3\n")
    import torch.distributed as dist
    dist.barrier()
    resumed, _ = run_training(tiny(lay, model=DROPOUT, train={"train_iters": 6},
                                   checkpoint={"save": resume, "load": resume}))
    return straight.losses, resumed.losses


def test_resume_is_exact_under_interleaved_pipeline(tmp_path):
    (tmp_path / "resume").mkdir()
    straight, resumed = run_distributed(RESUME.world_size, _resume_body, RESUME,
                                        str(tmp_path / "straight"),
                                        str(tmp_path / "resume"))[-1]
    assert list(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)]  # bitwise
