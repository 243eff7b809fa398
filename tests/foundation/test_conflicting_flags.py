"""Flags that contradict each other, or one that another makes meaningless, are refused
before any work with one line naming the values and the fix (exit code 2); the good
combinations around them keep working, from the command line and from a YAML file."""

from __future__ import annotations

import subprocess

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from tests.training.common import ENTRYPOINT, PYTHON, subprocess_env

CASES = [
    (["--mock-data", "--data-path", "0.5", "a", "0.5", "b"],
     "--mock-data with --data-path 0.5 a 0.5 b: mock data is synthetic and would never read "
     "--data-path; drop --mock-data to train on the data, or drop --data-path"),
    (["--mock-data", "--train-data-path", "t", "--valid-data-path", "v"],
     "--mock-data with --train-data-path t, --valid-data-path v: mock data is synthetic and "
     "would never read --train-data-path / --valid-data-path"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"],
     "--use-distributed-optimizer shards the optimizer state over data parallel ranks "
     "(--data-parallel-sharding-strategy optim), which contradicts "
     "--data-parallel-sharding-strategy no_shard; drop one of the two"),
    (["--optimizer-offload-fraction", "0.5"],
     "--optimizer-offload-fraction 0.5 has no effect without --optimizer-cpu-offload (the "
     "fraction says how much of the optimizer state the offload moves to the host); add "
     "--optimizer-cpu-offload, or drop --optimizer-offload-fraction"),
]


@pytest.mark.parametrize("flags, message", CASES, ids=["mock+data", "mock+split-paths",
                                                       "distopt+no_shard", "fraction"])
def test_refused_in_process(flags, message):
    with pytest.raises(ConfigError) as e:
        parse_args(["--train-iters", "1", *flags])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, message", [CASES[0], CASES[2], CASES[3]],
                         ids=["mock+data", "distopt+no_shard", "fraction"])
def test_pretrain_refuses_with_one_line_and_exit_2(flags, message):
    """The command a user runs: pretrain_gpt.py stops at its flags, before any work."""
    out = subprocess.run([PYTHON, ENTRYPOINT, "--train-iters", "1", *flags],
                         capture_output=True, text=True, timeout=120, env=subprocess_env())
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert lines == [lines[0]] and lines[0].startswith("megalite: error: ")
    assert message in lines[0]


def test_yaml_keys_are_refused_the_same_way(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("parallel:\n  use_distributed_optimizer: true\n"
                 "  data_parallel_sharding_strategy: no_shard\n")
    with pytest.raises(ConfigError, match="contradicts --data-parallel-sharding-strategy"):
        parse_args(["--config", str(f)])
    f.write_text("mock_data: true\ndata_path: [a]\n")
    with pytest.raises(ConfigError, match="--mock-data with --data-path a"):
        parse_args(["--config", str(f)])


@pytest.mark.parametrize("flags, yaml, strategy", [
    ([], "", "no_shard"),
    (["--use-distributed-optimizer"], "", "optim"),
    (["--data-parallel-sharding-strategy", "no_shard"], "", "no_shard"),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"], "",
     "optim_grads"),
    ([], "use_distributed_optimizer: true\n", "optim"),
    ([], "data_parallel_sharding_strategy: no_shard\n", "no_shard"),
    (["--data-parallel-sharding-strategy", "optim"], "use_distributed_optimizer: true\n",
     "optim"),
])
def test_good_sharding_flags_resolve_as_before(tmp_path, flags, yaml, strategy):
    f = tmp_path / "run.yaml"
    f.write_text(yaml or "{}\n")
    p = parse_args(["--config", str(f), *flags]).parallel
    assert (p.data_parallel_sharding_strategy, p.use_distributed_optimizer) == (
        strategy, strategy != "no_shard")


def test_good_data_and_offload_flags_still_parse():
    assert parse_args(["--mock-data"]).data.mock_data
    assert parse_args(["--data-path", "a"]).data.data_path == ["a"]
    o = parse_args(["--use-distributed-optimizer", "--optimizer-cpu-offload",
                    "--optimizer-offload-fraction", "0.5"]).optim
    assert (o.optimizer_cpu_offload, o.optimizer_offload_fraction) == (True, 0.5)
    assert parse_args(["--optimizer-offload-fraction", "1.0"]).optim.optimizer_offload_fraction == 1
