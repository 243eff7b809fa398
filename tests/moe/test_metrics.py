"""MoE router losses in the metrics: JSONL keys and the human line's window mean."""

import io

from megalite.config import LoggingConfig
from megalite.training.metrics import IterationMetrics, MetricsLogger
from tests.training.common import read_jsonl


def _metrics(i):
    return IterationMetrics(iteration=i, lm_loss=4.0, grad_norm=0.5, lr=1e-3,
                            loss_scale=1.0, skipped=False, tokens_per_sec=1e4, mfu=0.1,
                            elapsed_s=0.1, consumed_samples=8 * i, global_batch_size=8)


def test_moe_losses_reach_jsonl_and_human_line(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    out = io.StringIO()
    log = MetricsLogger(LoggingConfig(log_interval=2, metrics_jsonl=path), train_iters=2,
                        enabled=True, stream=out)
    log.record(_metrics(1), extra={"moe_aux_loss": 0.01, "moe_z_loss": 0.002})
    log.record(_metrics(2), extra={"moe_aux_loss": 0.03, "moe_z_loss": 0.004})
    log.close()
    rows = read_jsonl(path)
    assert [(r["moe_aux_loss"], r["moe_z_loss"]) for r in rows] == [(0.01, 0.002),
                                                                    (0.03, 0.004)]
    line = out.getvalue().splitlines()[0]
    assert "| lm loss: 4.000000E+00 | moe aux loss: 2.000000E-02 | moe z loss: " \
           "3.000000E-03 | loss scale:" in line
