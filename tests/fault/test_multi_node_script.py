"""scripts/pretrain_multi_node.sh's command line, read from a stand-in python that prints
its arguments: restarts on, the rendezvous endpoint, MODEL_ARGS, NODE_RANK said to be
ignored."""

from __future__ import annotations

import os
import subprocess

from tests.training.common import REPO

SCRIPT = os.path.join(REPO, "scripts", "pretrain_multi_node.sh")


def _run(tmp_path, **settings) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "ARGS $*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    env.update(PYTHON=str(fake), DATA_PATH="d", TOKENIZER_MODEL="t", **settings)
    return subprocess.run(["bash", SCRIPT, "--extra-flag"], env=env, capture_output=True,
                          text=True, timeout=60)


def _args(done) -> list[str]:
    line = next(x for x in done.stdout.splitlines() if x.startswith("ARGS "))
    return line.split()[1:]


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_restarts_are_on_and_the_endpoint_is_master_addr(tmp_path):
    done = _run(tmp_path, NNODES="2", MASTER_ADDR="node0")
    assert done.returncode == 0, done.stderr
    args = _args(done)
    assert args[:2] == ["-m", "megalite.launch"]
    assert _value(args, "--max-restarts") == "3"
    assert _value(args, "--rdzv_endpoint") == "node0:29500"
    assert _value(args, "--nnodes") == "2" and "--node_rank" not in args
    assert "--bf16" in args and _value(args, "--num-layers") == "32"
    assert args[-1] == "--extra-flag" and "NODE_RANK" not in done.stderr


def test_an_outside_rendezvous_model_args_and_node_rank(tmp_path):
    done = _run(tmp_path, NNODES="1:2", RDZV_ENDPOINT="login1:29400", MAX_RESTARTS="7",
                MODEL_ARGS="--num-layers 2 --hidden-size 64", NODE_RANK="1")
    assert done.returncode == 0, done.stderr
    args = _args(done)
    assert _value(args, "--rdzv_endpoint") == "login1:29400"
    assert _value(args, "--max-restarts") == "7" and _value(args, "--nnodes") == "1:2"
    assert _value(args, "--num-layers") == "2" and "--bf16" not in args
    assert ("NODE_RANK=1 is ignored: c10d gives global rank 0 to the node whose address "
            "sorts first") in done.stderr


def test_without_an_endpoint_it_says_what_to_set(tmp_path):
    done = _run(tmp_path, NNODES="2")
    assert done.returncode == 2
    assert "set MASTER_ADDR (a node of the job) or RDZV_ENDPOINT" in done.stderr
