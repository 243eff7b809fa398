"""``scripts/pretrain_tiny_deepseek_cpu.sh``: a tiny DeepSeek-V3-style model (multi-latent
attention, 8 fine-grained experts top-2 with a shared expert and the expert bias, one
multi-token prediction depth, expert parallel 2) on the bundled corpus with 2 CPU ranks,
shortened here to 6 iterations of 4 sequences of 32 tokens: the script exits 0, the loss
and the depth's loss fall, the checkpoint is written, and it ends by generating."""

import os
import subprocess
import sys

from tests.training.common import REPO, read_jsonl, subprocess_env


def test_tiny_deepseek_script_trains_and_generates(tmp_path):
    out = tmp_path / "run"
    env = subprocess_env(OUT=str(out), TRAIN_ITERS="6", SEQ_LEN="32", MICRO_BATCH="2",
                         GLOBAL_BATCH="4", PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "pretrain_tiny_deepseek_cpu.sh"),
         "--log-interval", "2", "--eval-interval", "6", "--eval-iters", "1",
         "--save-interval", "6", "--lr-warmup-iters", "1"],
        capture_output=True, text=True, env=env, timeout=400, check=False)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    rows = read_jsonl(str(out / "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.3
    assert rows[-1]["mtp_1_loss"] < rows[0]["mtp_1_loss"] - 0.3
    assert all("moe_aux_loss" in r and "expert_load" in r for r in rows)
    assert (out / "checkpoints" / "iter_0000006").is_dir()
    assert "mtp_1 loss:" in done.stdout
    samples = [line for line in done.stdout.splitlines() if line.startswith("[And God said]")]
    assert len(samples) == 2 and all(len(s) > len("[And God said]") + 20 for s in samples)
