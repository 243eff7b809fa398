"""Layout equivalence of pipeline parallelism: pp x virtual x tp x dp x SP.

Each layout trains the same tiny GPT (8 layers, tied embeddings, fp32, dropout 0) for 6
iterations; its per-iteration loss must match the single-process run, and the final word
embedding (first stage) and its tied copy in the output layer (last stage) must match the
single-process embedding -- so the tied gradients were summed over the embedding group.
"""

import torch

from megalite.training.forward_backward import model_chunks
from tests.distributed.harness import run_distributed
from tests.training.common import run_training, tiny_config

ITERS = 6
LOSS_TOL = 2e-5
PARAM_TOL = 5e-5
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


def _cfg(world, **parallel):
    return tiny_config(world, model={"num_layers": 8},
                       parallel=parallel,
                       train={"micro_batch_size": 1, "global_batch_size": 8,
                              "train_iters": ITERS})


def _train(rank, world_size, layouts):
    out = []
    for parallel in layouts:
        result, c = run_training(_cfg(world_size, **parallel))
        tensors = {}
        for chunk in model_chunks(c.model):
            full = chunk.full_state_dict()  # collective over tp
            for name in (EMBEDDING, OUTPUT):
                if name in full:
                    tensors[name] = full[name]
        out.append((result.losses, tensors))
    return out


def _reference():
    result, c = run_training(_cfg(1))
    return result.losses, c.model.full_state_dict()[EMBEDDING]


def _check(world, layouts):
    ref_losses, ref_embedding = _reference()
    assert len(ref_losses) == ITERS and ref_losses[ITERS] < ref_losses[1]
    results = run_distributed(world, _train, layouts)
    for n, layout in enumerate(layouts):
        for rank_out in results:
            losses, tensors = rank_out[n]
            for it in ref_losses:
                assert abs(losses[it] - ref_losses[it]) < LOSS_TOL, (layout, it, losses[it],
                                                                      ref_losses[it])
            for name, tensor in tensors.items():
                torch.testing.assert_close(tensor, ref_embedding, rtol=0, atol=PARAM_TOL,
                                           msg=lambda m: f"{layout} {name}: {m}")
        names = {name for rank_out in results for name in rank_out[n][1]}
        assert EMBEDDING in names and OUTPUT in names  # both copies were checked


def test_pp2_world2():
    _check(2, [dict(pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3)])


def test_pp_world4():
    _check(4, [dict(pipeline_model_parallel_size=4),
               dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                    sequence_parallel=True, virtual_pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)])


def test_pp_world8():
    _check(8, [dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                    sequence_parallel=True, virtual_pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=4, tensor_model_parallel_size=2),
               dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
               dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                    virtual_pipeline_model_parallel_size=4)])


RESUME_MODEL = {"num_layers": 4, "hidden_dropout": 0.2, "attention_dropout": 0.1}


def _resume_body(rank, world_size, save, resume):
    """Dropout on: the RNG tracker shared by a rank's chunks is checkpointed too."""
    par = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    straight, _ = run_training(tiny_config(
        world_size, model=RESUME_MODEL, parallel=par,
        train={"train_iters": 6, "micro_batch_size": 1, "global_batch_size": 4},
        checkpoint={"save": save, "save_interval": 3}))
    if rank == 0:  # keep only the iteration-3 checkpoint for the resumed run
        import shutil
        shutil.copytree(f"{save}/iter_0000003", f"{resume}/iter_0000003")
        with open(f"{resume}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("3\n")
    import torch.distributed as dist
    dist.barrier()
    resumed, _ = run_training(tiny_config(
        world_size, model=RESUME_MODEL, parallel=par,
        train={"train_iters": 6, "micro_batch_size": 1, "global_batch_size": 4},
        checkpoint={"save": resume, "load": resume}))
    return straight.losses, resumed.losses


def test_resume_is_exact_under_interleaved_pipeline(tmp_path):
    (tmp_path / "resume").mkdir()
    straight, resumed = run_distributed(2, _resume_body, str(tmp_path / "straight"),
                                        str(tmp_path / "resume"))[-1]
    assert list(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)]  # bitwise
