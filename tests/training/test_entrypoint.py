"""pretrain/pretrain_gpt.py as users run it: torchrun, a rank killed mid-save, SIGTERM.

These start real processes (a few seconds each), so there are only a few.
"""

import os
import signal
import subprocess
import textwrap
import time

from megalite.checkpoint import read_latest_iteration
from megalite.parallel.state import ParallelState
from megalite.training.build import build_components
from tests.training.common import (
    ENTRYPOINT,
    PYTHON,
    read_jsonl,
    start_two_ranks,
    subprocess_env,
    tiny_config,
    tiny_flags,
)

CRASHING_DRIVER = textwrap.dedent("""
    # Run the entrypoint, but global rank 0 dies (os._exit) half-way through writing its
    # file of the checkpoint at iteration {crash_at}, as a node failure would.
    import os, runpy
    from megalite.checkpoint import save

    real_write = save.write_blocks

    def write(state, pieces, directory, group, no_dist):
        if directory.endswith("iter_{crash_at:07d}.tmp") and os.environ["RANK"] == "0":
            with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
                f.write(b"half a checkpoint")
                f.flush()
            os._exit(9)
        real_write(state, pieces, directory, group, no_dist)

    save.write_blocks = write
    runpy.run_path({entrypoint!r}, run_name="__main__")
""")


def test_torchrun_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    driver = tmp_path / "driver.py"
    driver.write_text(CRASHING_DRIVER.format(crash_at=4, entrypoint=ENTRYPOINT))
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(driver), *tiny_flags(**{"--train-iters": 6, "--save": save,
                                       "--save-interval": 2,
                                       "--metrics-jsonl": str(tmp_path / "m.jsonl")})]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "iteration        2/       6" in proc.stdout, proc.stdout + proc.stderr
    assert read_latest_iteration(save) == 2
    # the killed job's lock stays behind, stale (its pid is gone): the next job takes it over
    assert sorted(os.listdir(save)) == [".megalite.lock", "iter_0000002", "iter_0000004.tmp",
                                        "latest_checkpointed_iteration.txt"]
    # the previous checkpoint (saved by dp=2) still loads, here into one process
    cfg = tiny_config(checkpoint={"load": save})
    c = build_components(cfg, ParallelState.build(cfg.parallel), peak_probe_seconds=0.01)
    assert (c.state.iteration, c.state.consumed_train_samples) == (2, 16)
    c.close()


def test_sigterm_to_one_rank_saves_and_exits_zero(tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    flags = tiny_flags(**{"--train-iters": 100000, "--save": save, "--metrics-jsonl": metrics,
                          "--exit-signal-handler": None, "--log-interval": 1000})
    procs = start_two_ranks(flags, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(metrics) and len(read_jsonl(metrics)) >= 3):
            assert time.monotonic() < deadline, "training did not start"
            assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)   # only one rank gets the signal
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    last = read_jsonl(metrics)[-1]["iteration"]
    assert 3 <= last < 100000
    assert read_latest_iteration(save) == last
    assert f"exiting at iteration {last}: signal" in outputs[1]
    assert f"saved checkpoint at iteration {last}" in outputs[0]


def _entrypoint_main():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_gpt", ENTRYPOINT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_single_process_main_with_yaml_config(tmp_path, capsys):
    main = _entrypoint_main()
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  num_layers: 2\n  hidden_size: 32\n"
                      "train:\n  train_iters: 3\n  micro_batch_size: 2\n")
    metrics = str(tmp_path / "m.jsonl")
    argv = ["--config", str(config), *tiny_flags(**{"--train-iters": None,
                                                    "--metrics-jsonl": metrics})]
    argv.remove("--train-iters")
    assert main(argv) == 0
    assert [r["iteration"] for r in read_jsonl(metrics)] == [1, 2, 3]
    assert "training stopped at iteration 3 (finished)" in capsys.readouterr().out
    assert main(tiny_flags(**{"--global-batch-size": 7})) == 2
    assert "global_batch_size (7) must be divisible" in capsys.readouterr().err
