"""fp8 flags: parsed and validated; where fp8 cannot run, training stops before any work
with one sentence naming the reason and the flags to drop."""

import subprocess

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError, ModelConfig
from megalite.training.fp8 import check_fp8_available, fp8_flags
from tests.training.common import ENTRYPOINT, PYTHON, subprocess_env, tiny_flags

LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
              "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]


def test_fp8_flags_parse():
    cfg = parse_args(LLAMA3_FP8 + ["--fp8-recipe", "delayed"]).model
    assert (cfg.fp8_format, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo,
            cfg.fp8_param_gather, cfg.fp8_recipe) == ("hybrid", 1024, "max", True, "delayed")
    assert fp8_flags(cfg) == ["--fp8-format", "--fp8-amax-history-len",
                              "--fp8-amax-compute-algo", "--fp8-param-gather"]
    assert fp8_flags(ModelConfig()) == []


@pytest.mark.parametrize("argv", [["--fp8-format", "e5m2"],
                                  ["--fp8-amax-compute-algo", "mean"],
                                  ["--fp8-recipe", "nvfp4"],
                                  ["--fp8-amax-history-len", "0"],
                                  ["--fp8-param-gather"]])
def test_fp8_flags_are_validated(argv):
    with pytest.raises(ConfigError):
        parse_args(argv)


def test_check_is_silent_without_fp8_and_refuses_cpu():
    check_fp8_available(ModelConfig(), "cpu")
    with pytest.raises(ConfigError, match="device is cpu.*drop --fp8-format"):
        check_fp8_available(ModelConfig(fp8_format="e4m3"), "cpu")


def test_entrypoint_stops_with_one_sentence(tmp_path):
    metrics = tmp_path / "m.jsonl"
    cmd = [PYTHON, ENTRYPOINT, *tiny_flags(**{"--metrics-jsonl": str(metrics)}),
           "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in proc.stderr.splitlines() if "fp8" in line]
    assert len(errors) == 1, out
    assert "fp8 training cannot run here" in errors[0]
    assert "drop --fp8-format --fp8-amax-history-len" in errors[0]
    assert not metrics.exists()  # no iteration ran
