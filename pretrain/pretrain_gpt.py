"""Pretrain a GPT / Llama model: parse flags -> process groups -> build -> train.

    torchrun --nproc_per_node 2 pretrain/pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 100 --lr 1e-3 \\
        --mock-data --vocab-size 1000 --save ckpt --save-interval 50
    python pretrain/pretrain_gpt.py --config run.yaml          # one process
    python pretrain/pretrain_gpt.py --dry-run --world-size 1024 --rank 7 ...  # check a layout

Flags are Megatron-LM's (``megalite.arguments``). Exit status: 0 when training finished or
stopped on ``--exit-interval`` / ``--exit-duration-in-mins`` / SIGTERM with
``--exit-signal-handler`` (a checkpoint is saved first when ``--save`` is set); 2 on a bad
flag or configuration; 3 on a data error; 4 on a checkpoint error; 5 on a numerical error
(NaN loss); 130 after Ctrl-C without ``--exit-signal-handler`` (one line per rank); 1 on
any other error (see ``megalite.errors``). A known error prints one line
per rank, ``megalite: error (rank R): ...`` (its traceback too with ``MEGALITE_TRACEBACK=1``);
any other keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

import torch.distributed as dist

from megalite.arguments import main_parse
from megalite.compat import no_effect_line
from megalite.errors import record_exit_code, report_error
from megalite.parallel import watchdog
from megalite.parallel.device import DeviceSetupError, check_device_setup
from megalite.parallel.state import ParallelState, init_distributed
from megalite.training.build import build_components
from megalite.training.loop import train


def main(argv: Sequence[str] | None = None) -> int:
    from megalite.planner.dry_run import dry_run, split_dry_run_flags

    try:  # --dry-run --world-size N --rank R: rank R's part of the layout, no peers
        argv, dry = split_dry_run_flags(list(sys.argv[1:] if argv is None else argv))
    except Exception as e:
        return report_error(e, 0) or 2
    cfg = main_parse(argv)
    if dry is not None:
        try:
            print(dry_run(cfg, *dry), flush=True)
            return 0
        except Exception as e:
            code = report_error(e, dry[1])
            if code is None:
                raise
            return code
    try:  # GPU set-up mistakes (ranks > GPUs, nccl without CUDA, ...): one line, before any work
        check_device_setup(cfg)
        rank, world = init_distributed(cfg.parallel.distributed_backend,
                                       cfg.parallel.distributed_timeout_minutes,
                                       device=cfg.parallel.device)
    except DeviceSetupError as e:
        return report_error(e, int(os.environ.get("RANK", "0")))
    ignored = no_effect_line(cfg)
    if rank == 0 and ignored:
        print(ignored, flush=True)
    ps = None
    # hangs and dead peers name the rank; the flight recorder goes beside the metrics
    metrics = cfg.logging.metrics_jsonl
    watchdog.start(cfg.parallel.distributed_timeout_minutes,
                   os.path.dirname(os.path.abspath(metrics)) if metrics else None)
    try:
        cfg.validate(world)
        ps = ParallelState.build(cfg.parallel)
        components = build_components(cfg, ps)
        try:
            result = train(components)
        finally:
            components.close()
        if rank == 0:
            print(f" training stopped at iteration {result.iteration} "
                  f"({result.exit_reason})", flush=True)
        return 0
    except KeyboardInterrupt:   # Ctrl-C without --exit-signal-handler (or before the loop)
        # one write of the whole line: the ranks share the terminal
        sys.stderr.write(f"megalite: interrupted (rank {rank}): stopped by SIGINT (Ctrl-C) "
                         "without saving; --exit-signal-handler saves a checkpoint on it\n")
        sys.stderr.flush()
        return 130
    except Exception as e:
        code = report_error(e, rank)
        if code is None:
            raise
        return code
    finally:
        watchdog.stop()
        if ps is not None:
            ps.destroy()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_code = main()          # an unknown error raises: no code recorded, torchrun's stays
    record_exit_code(exit_code)
    sys.exit(exit_code)
