"""Gradient buffers and optimizer for a model, from the run's configuration."""

from __future__ import annotations

from megalite.config import MegaliteConfig
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.loss_scaler import build_loss_scaler
from megalite.optim.optimizer import MixedPrecisionOptimizer
from megalite.parallel.state import ParallelState


def build_grads_and_optimizer(model, cfg: MegaliteConfig, ps: ParallelState, timers=None):
    """``(DataParallelGrads, optimizer)`` for ``model`` (a Module or its pipeline chunks,
    already in its training dtype and on its device): the distributed optimizer under
    ``--data-parallel-sharding-strategy optim`` (``--use-distributed-optimizer``) or
    ``optim_grads`` (gradients sharded too) or ``optim_grads_params`` (parameters sharded
    too, gathered per layer: :mod:`megalite.optim.param_sharding`), else
    :class:`MixedPrecisionOptimizer`;
    buckets, overlap and reduction dtype from ``cfg.parallel``, CPU offload from
    ``cfg.optim``."""
    p = cfg.parallel
    grads = DataParallelGrads(model, ps, p.ddp_bucket_size, timers,
                              overlap_grad_reduce=p.overlap_grad_reduce,
                              use_distributed_optimizer=p.use_distributed_optimizer,
                              grad_reduce_in_bf16=p.grad_reduce_in_bf16,
                              overlap_param_gather=p.overlap_param_gather,
                              shard_grads=p.data_parallel_sharding_strategy == "optim_grads",
                              shard_params=p.data_parallel_sharding_strategy
                              == "optim_grads_params",
                              fp8_param_gather=cfg.model.fp8_param_gather)
    scaler = build_loss_scaler(cfg.optim, cfg.model.fp16)
    if p.use_distributed_optimizer:
        optimizer = DistributedOptimizer(model, cfg.optim, ps, scaler, grads,
                                         fp16=cfg.model.fp16)
    else:
        optimizer = MixedPrecisionOptimizer(model, cfg.optim, ps, scaler, fp16=cfg.model.fp16)
    return grads, optimizer
