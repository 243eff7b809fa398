"""Launch mistakes on a real GPU host stop with one line per rank instead of a CUDA
traceback: more ranks on the node than visible GPUs (torchrun --nproc_per_node GPUs+1).
(torchrun's own summary of the failed ranks follows them.) torchrun stops the other ranks
as soon as one exits, so a rank that had not reached the check yet prints nothing: at least
one line, at most one per rank, each of them right."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.training.common import ENTRYPOINT, PYTHON, subprocess_env, tiny_flags

pytestmark = pytest.mark.gpu


def test_more_ranks_than_gpus_is_at_most_one_line_per_rank(tmp_path):
    gpus = torch.cuda.device_count()
    ranks = gpus + 1
    proc = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
         "--no-python", PYTHON, ENTRYPOINT,
         *tiny_flags(**{"--distributed-backend": "auto", "--device": "cuda"})],
        env=subprocess_env(MEGALITE_DEVICE="auto"), capture_output=True, text=True,
        timeout=300, check=False, cwd=tmp_path)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("megalite: error")]
    assert 1 <= len(errors) <= ranks, proc.stderr[-3000:]
    for line in errors:
        assert f"{ranks} ranks on this node" in line and f"but {gpus} visible GPU" in line, line
        assert f"--nproc_per_node {gpus}" in line
    assert "invalid device ordinal" not in proc.stderr  # the rank stopped before CUDA work
