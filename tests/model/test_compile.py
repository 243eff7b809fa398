"""``--compile``: training with compiled transformer layers reproduces the eager loss curve.

Inductor reorders float operations, so compiled and eager runs agree to rounding, not
bit for bit: fp32 losses within rtol 1e-5. Compiling on CPU takes tens of seconds per
layer graph, so the runs are few and tiny (2-4 layers, hidden 64, 3 iterations, fixed
shapes) and marked slow (``make test-all`` runs them); inductor's on-disk cache shares
the compiled graphs between the runs of one machine.
"""

from __future__ import annotations

import json

import pytest
import torch

from megalite.config import ConfigError, TrainConfig
from megalite.models.compile import compile_model, eager_parts, transformer_layers
from tests.distributed.harness import run_distributed
from tests.model.common import llama_config, mixtral_config, single_process_state
from tests.training.common import run_training, tiny_config

LLAMA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 96,
         "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def _losses(world_size: int, compile: bool, path: str, parallel: dict, model: dict,
            rank: int) -> list[float] | None:
    cfg = tiny_config(world_size, model={**LLAMA, **model}, parallel=parallel,
                      train={"train_iters": 3, "compile": compile},
                      logging={"metrics_jsonl": path})
    run_training(cfg)
    if rank != world_size - 1:  # the metrics file is written by the last rank
        return None
    with open(path) as f:
        return [json.loads(line)["lm_loss"] for line in f]


def _eager_and_compiled(rank, world_size, tmp, parallel, model):
    torch._dynamo.reset()
    eager = _losses(world_size, False, f"{tmp}/eager.jsonl", parallel, model, rank)
    compiled = _losses(world_size, True, f"{tmp}/compiled.jsonl", parallel, model, rank)
    return eager, compiled


def _check(eager, compiled):
    assert len(eager) == len(compiled) == 3
    assert eager[-1] < eager[0]  # it trains
    torch.testing.assert_close(torch.tensor(compiled, dtype=torch.float64),
                               torch.tensor(eager, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_compiled_layers_match_eager_with_full_recompute(tmp_path):
    """One process; the first layer is checkpointed (a compiled layer recomputed in
    backward), the second not."""
    recompute = {"recompute_granularity": "full", "recompute_method": "block",
                 "recompute_num_layers": 1}
    _check(*_eager_and_compiled(0, 1, tmp_path, {}, recompute))


@pytest.mark.slow
@pytest.mark.parametrize("parallel,model", [
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True},
     {"recompute_granularity": "selective"}),
    ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
     {"num_layers": 4}),
], ids=["tp2-sp-selective", "pp2-vpp2"])
def test_compiled_layers_match_eager_on_two_ranks(tmp_path, parallel, model):
    """tp=2 with sequence parallelism (the layer's collectives inside the compiled region,
    the attention block eager under selective recompute), and interleaved pipeline chunks."""
    results = run_distributed(2, _eager_and_compiled, str(tmp_path), parallel, model,
                              timeout=600)
    _check(*results[-1])


def test_eager_parts_are_moe_mlps_and_selectively_recomputed_attention():
    ps = single_process_state()
    from megalite.models.gpt import GPTModel

    dense = GPTModel(llama_config(), ps)
    assert [eager_parts(layer) for layer in transformer_layers(dense)] == [[], []]
    selective = GPTModel(llama_config(recompute_granularity="selective"), ps)
    assert [eager_parts(layer) for layer in transformer_layers(selective)] == [
        [layer.self_attention] for layer in selective.decoder.layers.values()]
    moe = GPTModel(mixtral_config(), ps)
    assert [eager_parts(layer) for layer in transformer_layers(moe)] == [
        [layer.mlp] for layer in moe.decoder.layers.values()]
    chunks = torch.nn.ModuleList([dense, moe])  # pipeline chunks: every chunk's layers
    assert len(transformer_layers(chunks)) == 4


def test_bad_compile_settings_fail_with_one_sentence():
    ps = single_process_state()
    from megalite.models.gpt import GPTModel

    with pytest.raises(ConfigError, match="unknown torch.compile mode 'fastest'"):
        compile_model(GPTModel(llama_config(), ps), mode="fastest")
    with pytest.raises(ConfigError, match="--compile-mode max-autotune needs --compile"):
        TrainConfig(compile_mode="max-autotune")
