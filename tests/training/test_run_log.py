"""What a run's logs look like to a Megatron user, and after a resume: the JSONL, TensorBoard
and wandb keep each iteration once; the wandb run continues under its id."""

import contextlib
import io
import json
import os
import re

from megalite.checkpoint.files import read_metadata
from megalite.config import LoggingConfig
from megalite.training.components import WANDB_RUN_ID
from megalite.training.metrics import MetricsLogger
from tests.distributed.harness import run_distributed
from tests.training.common import only_iteration, read_jsonl, run_training, tiny_config
from tests.training.test_metrics import _metrics


def test_resume_at_truncates_jsonl_rows_after_the_iteration(tmp_path):
    path = tmp_path / "m.jsonl"
    lcfg = LoggingConfig(log_interval=100, metrics_jsonl=str(path))
    log = MetricsLogger(lcfg, train_iters=8, enabled=True, stream=io.StringIO())
    for i in range(1, 7):
        log.record(_metrics(i, 1.0 / i))
    log.close()
    with open(path, "a") as f:
        f.write('{"iteration": 7, "lm_lo')   # torn by a kill
    out = io.StringIO()
    log = MetricsLogger(lcfg, train_iters=8, enabled=True, stream=out)
    log.resume_at(4)
    log.record(_metrics(5, 0.5))
    log.close()
    assert [r["iteration"] for r in read_jsonl(str(path))] == [1, 2, 3, 4, 5]
    assert "dropped 3 later row(s)" in out.getvalue()
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def _scalars(tb_dir: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resume_keeps_each_iteration_once_and_the_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    jsonl, tb, wb = str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), str(tmp_path / "wandb")
    logging = {"log_interval": 100, "metrics_jsonl": jsonl, "tensorboard_dir": tb,
               "wandb_project": "megalite-test", "wandb_save_dir": wb}
    save = str(tmp_path / "ckpt")
    full, c1 = run_training(tiny_config(checkpoint={"save": save, "save_interval": 4},
                                        logging=logging))
    run_id = read_metadata(os.path.join(save, "iter_0000004"))[WANDB_RUN_ID]
    assert run_id == c1.wandb_id == c1.metrics.wandb_id
    assert read_metadata(os.path.join(save, "iter_0000008"))[WANDB_RUN_ID] == run_id

    older = only_iteration(save, str(tmp_path / "older"), 4)   # resume from iteration 4
    resumed, c2 = run_training(tiny_config(checkpoint={"load": older, "save": older,
                                                       "save_interval": 4},
                                           logging=logging))
    assert resumed.losses == {i: full.losses[i] for i in range(5, 9)}
    rows = read_jsonl(jsonl)
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    assert [r["lm_loss"] for r in rows] == [full.losses[i] for i in range(1, 9)]
    steps = [s for s, _ in _scalars(tb, "lm loss")]
    assert sorted(steps) == list(range(1, 9)), steps
    assert c2.wandb_id == run_id and c2.metrics.wandb_id == run_id
    assert read_metadata(os.path.join(older, "iter_0000008"))[WANDB_RUN_ID] == run_id
    runs = [r for r in os.listdir(os.path.join(wb, "wandb")) if r.startswith("offline-run-")]
    # offline-run-<start time>-<run id>; wandb adds "-1" when both runs start in one second
    assert runs and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r)
                        for r in runs), runs


def test_finetune_starts_a_new_wandb_run_and_keeps_the_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    jsonl = str(tmp_path / "m.jsonl")
    logging = {"log_interval": 100, "metrics_jsonl": jsonl, "wandb_project": "megalite-test",
               "wandb_save_dir": str(tmp_path / "wandb")}
    save = str(tmp_path / "ckpt")
    _, c1 = run_training(tiny_config(train={"train_iters": 4}, logging=logging,
                                     checkpoint={"save": save, "save_interval": 4}))
    _, c2 = run_training(tiny_config(train={"train_iters": 2}, logging=logging,
                                     checkpoint={"load": save, "finetune": True}))
    assert c2.wandb_id != c1.wandb_id
    assert [r["iteration"] for r in read_jsonl(jsonl)] == [1, 2, 3, 4, 1, 2]
    assert json.dumps(c1.checkpoint_meta()) == json.dumps({WANDB_RUN_ID: c1.wandb_id})


def test_arguments_dump_at_start_up(capsys):
    cfg = tiny_config()
    run_training(cfg)
    out = capsys.readouterr().out.splitlines()
    start = out.index("------------------------ arguments ------------------------")
    end = out.index("-------------------- end of arguments ---------------------")
    body = out[start + 1:end]
    names = [line.split()[0] for line in body]
    every = [n for section in cfg.to_dict().values() for n in section]
    assert names == sorted(every, key=str.lower) and len(names) == len(set(every))
    assert "  hidden_size ..................................... 32" in body
    assert "  metrics_jsonl ................................... None" in body


def _count_lines_body(rank, world_size):
    cfg = tiny_config(world_size, parallel={"tensor_model_parallel_size": 2},
                      train={"train_iters": 1})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_training(cfg)
    return re.findall(r" > number of parameters on \(tensor, pipeline\) model parallel rank "
                      r"\((\d), (\d)\): (\d+)\n", out.getvalue())


def test_parameter_counts_once_per_tensor_pipeline_rank():
    per_rank = run_distributed(4, _count_lines_body)   # tp2 x dp2: dp rank 0 prints
    assert [len(lines) for lines in per_rank] == [1, 1, 0, 0]
    assert [lines[0][:2] for lines in per_rank[:2]] == [("0", "0"), ("1", "0")]
    assert per_rank[0][0][2] == per_rank[1][0][2] and int(per_rank[0][0][2]) > 0


def test_final_evaluation_at_the_end_of_training(capsys):
    split = {"split": "90,5,5"}
    plain, _ = run_training(tiny_config(train={"train_iters": 6}, data=split))
    ended, _ = run_training(tiny_config(train={"train_iters": 6, "eval_iters": 2,
                                               "eval_interval": 4}, data=split))
    assert ended.losses == plain.losses   # logging only: the curve is the same
    assert list(ended.valid_losses) == [4] and set(ended.final_losses) == {"validation", "test"}
    out = capsys.readouterr().out
    for label in ("validation", "test"):
        loss = ended.final_losses[label]
        assert (f" {label} loss at the end of training | lm loss value: {loss:.6E} |"
                in out), out
    # the last iteration ran a validation: only the test set is evaluated again
    again, _ = run_training(tiny_config(train={"train_iters": 8, "eval_iters": 2,
                                               "eval_interval": 4}, data=split))
    assert list(again.valid_losses) == [4, 8] and set(again.final_losses) == {"test"}
    assert "validation loss at the end of training" not in capsys.readouterr().out


def test_log_throughput_and_mfu_only_with_a_datasheet_peak():
    from megalite.arguments import parse_args

    assert not parse_args([]).logging.log_throughput          # off by default, as Megatron
    assert parse_args(["--log-throughput"]).logging.log_throughput
    assert not parse_args(["--log-throughput", "--no-log-throughput"]).logging.log_throughput
    m = _metrics(2, 1.0)
    m.tflops_per_gpu = 123.456
    for throughput, peak_known in ((True, True), (False, False)):
        lcfg = LoggingConfig(log_interval=2, log_throughput=throughput)
        out = io.StringIO()
        log = MetricsLogger(lcfg, train_iters=4, enabled=True, stream=out)
        log.mfu_in_line = peak_known
        log.record(_metrics(1, 1.0))
        log.record(m)
        line = out.getvalue()
        assert ("| throughput per GPU (TFLOP/s/GPU): 123.5 | tokens/s: 10000.0 |"
                in line) == throughput, line
        assert ("| MFU: 25.00% |" in line) == peak_known, line


def test_cpu_run_leaves_mfu_out_of_the_line_but_not_the_jsonl(tmp_path, capsys):
    jsonl = str(tmp_path / "m.jsonl")
    run_training(tiny_config(train={"train_iters": 2},
                             logging={"log_interval": 1, "metrics_jsonl": jsonl,
                                      "log_throughput": True}))
    lines = [x for x in capsys.readouterr().out.splitlines() if " iteration " in x]
    assert lines and all("throughput per GPU (TFLOP/s/GPU): " in x and "MFU" not in x
                         for x in lines)
    assert all(r["mfu"] > 0 for r in read_jsonl(jsonl))   # the probe's, as before


def test_batch_size_world_size_and_memory_reach_tensorboard(tmp_path):
    """Megatron's batch-size scalar (every iteration's global batch size, here under a
    ramp-up), --log-world-size-to-tensorboard and --log-memory-to-tensorboard (on CPU the
    process's resident memory), every --tensorboard-log-interval iterations."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    result, c = run_training(tiny_config(
        train={"rampup_batch_size": [2, 2, 12], "global_batch_size": 8,
               "micro_batch_size": 2, "train_iters": 8},
        logging={"tensorboard_dir": tb, "tensorboard_log_interval": 2,
                 "log_memory_to_tensorboard": True, "log_world_size_to_tensorboard": True}))
    batch = _scalars(tb, "batch-size")
    assert [s for s, _ in batch] == [2, 4, 6, 8]
    assert [v for _, v in batch] == [result.batch_sizes[s] for s in (2, 4, 6, 8)]
    assert len({v for _, v in batch}) > 1            # the ramp-up is visible
    assert [v for _, v in _scalars(tb, "world-size")] == [1.0] * 4
    rss, peak = _scalars(tb, "mem-resident-bytes"), _scalars(tb, "mem-max-resident-bytes")
    assert [s for s, _ in rss] == [2, 4, 6, 8]
    assert all(50e6 < v < 64e9 for _, v in rss)      # a python with torch: tens of MB up
    assert all(p >= r for (_, r), (_, p) in zip(rss, peak))
    assert "mem-allocated-bytes" not in EventAccumulator(tb).Reload().Tags()["scalars"]


def test_memory_scalars_on_cuda_are_megatrons(monkeypatch):
    import torch

    from megalite.training.memory_log import tensorboard_memory_scalars

    stats = {"reserved_bytes.all.current": 40, "allocated_bytes.all.current": 30,
             "allocated_bytes.all.peak": 35, "allocation.all.current": 7}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert tensorboard_memory_scalars(torch.device("cuda", 0)) == {
        "mem-reserved-bytes": 40, "mem-allocated-bytes": 30, "mem-max-allocated-bytes": 35,
        "mem-allocated-count": 7}
