"""Megatron-LM's Qwen3-30B-A3B model flags (``tools/megatron_flags.py``'s
``QWEN3_30B_A3B``, the MODEL_ARGS of its examples/post_training/modelopt/conf/qwen/
Qwen3-30B-A3B.sh) train here with only the sizes, the parallel sizes and the paths changed:
2 layers of 16 experts (8 per token, as the script routes), GQA with QK norm, tensor
parallel 2 with sequence parallelism and the experts over expert parallel 2 on 2 ranks, a
tiny HuggingFace tokenizer file for Qwen3's, mock data. What the script leaves to the
launch (batch, iterations, learning rate) is added."""

import os

import pytest

from megalite.arguments import parse_args
from megalite.compat import no_effect_line
from tests.distributed.harness import run_distributed
from tests.training.common import megatron_script_argv, read_jsonl, run_training

SIZES = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "64",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
    "--num-experts": "16", "--moe-ffn-hidden-size": "16", "--seq-length": "32",
    "--max-position-embeddings": "64", "--make-vocab-size-divisible-by": "16",
}
LAUNCH = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
          "--expert-tensor-parallel-size", "1", "--global-batch-size", "2",
          "--train-iters", "3", "--lr", "1e-4", "--eval-iters", "0", "--mock-data"]


def _argv(tmp: str) -> list[str]:
    return [*LAUNCH, "--tokenizer-model", os.path.join(tmp, "tokenizer.json"),
            "--save", os.path.join(tmp, "ckpt"), "--metrics-jsonl", os.path.join(tmp, "m.jsonl"),
            *megatron_script_argv("QWEN3_30B_A3B", SIZES)]


def _train(rank, world_size, argv):
    cfg = parse_args(argv)
    cfg.validate(world_size)
    result, _ = run_training(cfg)
    m = cfg.model
    return (result.losses, no_effect_line(cfg), m.qk_layernorm, m.moe_router_topk,
            m.recompute_modules, cfg.parallel.sequence_parallel)


def test_qwen3_30b_a3b_flags_train(tmp_path):
    from tests.data.test_tokenizers import _tiny_hf_tokenizer

    _tiny_hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    losses, line, qk_norm, topk, recompute, sp = \
        run_distributed(2, _train, _argv(str(tmp_path)))[0]
    assert sorted(losses) == [1, 2, 3]
    assert qk_norm and topk == 8 and sp
    assert recompute == ["core_attn", "moe"]          # --moe-layer-recompute
    rows = read_jsonl(str(tmp_path / "m.jsonl"))
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(0 < r["lm_loss"] < 10 for r in rows), rows
    for flag in ("--no-rope-fusion", "--no-bias-swiglu-fusion", "--use-mcore-models",
                 "--no-masked-softmax-fusion"):
        assert flag in line, flag


def test_moe_layer_recompute_is_selective_moe_recomputation():
    from megalite.config import ConfigError, ModelConfig

    def modules(**kw):
        return ModelConfig(num_experts=4, moe_layer_recompute=True, **kw).recompute_modules

    assert modules() == ["core_attn", "moe"]
    assert modules(recompute_granularity="selective", recompute_modules=["mlp"]) == \
        ["mlp", "moe"]
    assert modules(recompute_granularity="selective", recompute_modules=["moe"]) == ["moe"]
    with pytest.raises(ConfigError, match="cannot be combined with --recompute-granularity full"):
        ModelConfig(num_experts=4, moe_layer_recompute=True, recompute_granularity="full")
