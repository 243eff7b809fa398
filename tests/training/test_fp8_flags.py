"""fp8 flags: parsed and validated (fp16, untileable shapes, --fp8-param-gather without
the distributed optimizer or with a block recipe: one ConfigError each); fp8 trains on the
CPU from the entrypoint; a GPU without fp8 GEMMs is refused with the alternative."""

import subprocess
from unittest import mock

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError, ModelConfig
from megalite.layers.fp8 import Fp8Recipe
from megalite.training import fp8 as fp8_check
from megalite.training.fp8 import check_fp8_available, fp8_flags
from tests.training.common import ENTRYPOINT, PYTHON, read_jsonl, subprocess_env, tiny_flags

LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
              "--fp8-amax-compute-algo", "max"]


def test_fp8_flags_parse():
    cfg = parse_args(LLAMA3_FP8 + ["--fp8-recipe", "delayed", "--fp8-margin", "1",
                                   "--no-fp8-wgrad"]).model
    assert (cfg.fp8_format, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo,
            cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_wgrad) == (
                "hybrid", 1024, "max", "delayed", 1, False)
    assert Fp8Recipe.from_config(cfg).wgrad is False
    assert fp8_flags(cfg) == ["--fp8-format", "--fp8-margin", "--fp8-amax-history-len",
                              "--fp8-amax-compute-algo", "--no-fp8-wgrad"]
    assert fp8_flags(ModelConfig()) == []


@pytest.mark.parametrize("argv", [["--fp8-format", "e5m2"],
                                  ["--fp8-amax-compute-algo", "mean"],
                                  ["--fp8-recipe", "nvfp4"],
                                  ["--fp8-amax-history-len", "0"],
                                  ["--fp8-param-gather"]])
def test_fp8_flags_are_validated(argv):
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_fp8_with_fp16_is_one_error():
    with pytest.raises(ConfigError, match="with --fp16 is not supported.*use --bf16"):
        parse_args(["--fp8-format", "e4m3", "--fp16"])


def test_fp8_param_gather_needs_the_distributed_optimizer():
    from megalite.compat import no_effect_line

    cfg = parse_args(LLAMA3_FP8 + ["--fp8-param-gather"])
    assert "--fp8-param-gather" not in (no_effect_line(cfg) or "")
    with pytest.raises(ConfigError, match="--fp8-param-gather needs the distributed "
                       "optimizer.*add --use-distributed-optimizer"):
        cfg.validate(1)
    for extra in (["--use-distributed-optimizer"],
                  ["--data-parallel-sharding-strategy", "optim_grads_params"]):
        parse_args(LLAMA3_FP8 + ["--fp8-param-gather"] + extra).validate(2)


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise"])
def test_fp8_param_gather_refuses_block_recipes(recipe):
    with pytest.raises(ConfigError, match=f"--fp8-param-gather with --fp8-recipe {recipe} "
                       "is not supported.*use --fp8-recipe tensorwise or delayed"):
        parse_args(LLAMA3_FP8 + ["--fp8-param-gather", "--fp8-recipe", recipe])


@pytest.mark.parametrize("argv, match", [
    # hidden 40 is not a multiple of 16
    (["--hidden-size", "40", "--num-attention-heads", "4"], "hidden_size is 40"),
    # mxfp8: qkv 3 x 48 / tp 2 = 72 is not a multiple of 32
    (["--hidden-size", "48", "--num-attention-heads", "4", "--fp8-recipe", "mxfp8",
      "--tensor-model-parallel-size", "2"], "multiple of 32: hidden_size is 48.*tensorwise"),
    # cp 2 at seq 32 x micro-batch 1: chunks of 8 tokens cut the 16-token tiles
    (["--context-parallel-size", "2", "--micro-batch-size", "1"],
     "tokens per micro-batch and sequence chunk .* is 8"),
    # mxfp8 under grouped-query attention: 2 groups x 16 / tp 2 = 16 key columns per rank,
    # so the input gradient's 32-column blocks along QKV's [q | k | v] would straddle
    # k and v on a rank and not in the whole layout (the QKV output, 64, does tile)
    (["--fp8-recipe", "mxfp8", "--group-query-attention", "--num-query-groups", "2",
      "--tensor-model-parallel-size", "2"], "multiple of 32: the QKV projection's key part "
     r"per tp rank \(query groups x kv_channels / tp\) is 16"),
])
def test_untileable_shapes_are_one_error(argv, match):
    base = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--seq-length", "32",
            "--hidden-size", "64", "--num-attention-heads", "4"]
    cfg = parse_args(base + argv)
    world = cfg.parallel.tensor_model_parallel_size * cfg.parallel.context_parallel_size
    with pytest.raises(ConfigError, match=match):
        cfg.validate(world)


def test_first_last_layers_stay_in_higher_precision():
    cfg = ModelConfig(num_layers=6, fp8_format="hybrid", first_last_layers_bf16=True,
                      num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1)
    assert [Fp8Recipe.for_layer(cfg, n) is not None for n in range(6)] == [
        False, False, True, True, True, False]
    cfg.first_last_layers_bf16 = False
    assert all(Fp8Recipe.for_layer(cfg, n) is not None for n in range(6))


def test_cpu_runs_and_an_old_gpu_is_refused_with_the_alternative():
    check_fp8_available(ModelConfig(), "cpu")
    check_fp8_available(ModelConfig(fp8_format="e4m3"), "cpu")
    with mock.patch.object(fp8_check.torch.cuda, "is_available", return_value=True), \
            mock.patch.object(fp8_check.torch.cuda, "get_device_capability",
                              return_value=(8, 0)):
        with pytest.raises(ConfigError, match="capability 8.0.*drop --fp8-format to train "
                                              "in --bf16"):
            check_fp8_available(ModelConfig(fp8_format="e4m3"), "cuda")


def test_entrypoint_trains_in_fp8(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [PYTHON, ENTRYPOINT, *tiny_flags(**{"--metrics-jsonl": str(metrics),
                                              "--train-iters": 3}),
           "--fp8-format", "hybrid", "--fp8-amax-history-len", "4",
           "--fp8-amax-compute-algo", "max"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    rows = [r for r in read_jsonl(metrics) if "lm_loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(3.0 < r["lm_loss"] < 5.0 for r in rows), rows


def test_the_model_puts_fp8_where_the_flags_say():
    """Only the transformer layers' linears (and not those --first-last-layers-bf16 keeps)
    get fp8 scales; the output layer never does."""
    from megalite.models.gpt import GPTModel
    from megalite.layers.fp8 import Fp8Scaling
    from megalite.parallel.state import ParallelState
    from megalite.config import ParallelConfig

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64,
                      seq_length=16, fp8_format="e4m3", first_last_layers_bf16=True,
                      num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    ps = ParallelState.build(ParallelConfig())
    model = GPTModel(cfg, ps)
    fp8 = sorted(n.rsplit(".", 1)[0] for n, m in model.named_modules()
                 if isinstance(m, Fp8Scaling))
    assert fp8 == [f"decoder.layers.1.{p}" for p in (
        "mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj",
        "self_attention.linear_qkv")], fp8
