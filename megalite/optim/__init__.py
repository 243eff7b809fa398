"""Turning gradients into parameter updates.

``optim/`` holds every step between ``backward()`` and the updated weights: the
data-parallel gradient side (:mod:`~megalite.optim.grad_buffer`, the flat per-chunk
gradient/parameter buffers and their buckets; :mod:`~megalite.optim.data_parallel`,
:class:`DataParallelGrads`, Megatron's DDP: accumulation hooks and bucketed, optionally
overlapped reduction over ``ps.dp_cp`` / ``ps.edp``), the optimizers
(:mod:`~megalite.optim.optimizer` on fp32 masters, and
:mod:`~megalite.optim.distributed_optimizer` sharding masters and state over data
parallelism) around the ``--optimizer`` algorithms (:mod:`~megalite.optim.algorithms`, one
file each; Muon's whole-matrix orthogonalisation over the layout in
:mod:`~megalite.optim.muon_layout`), gradient clipping and inf/nan checks
(:mod:`~megalite.optim.clip_grads`), the loss scaler, learning-rate schedules,
optimizer-state helpers and memory accounting.
DDP and the grad buffers stay here rather than in a separate ``distributed/`` folder
because they exist to feed the optimizer (the distributed optimizer owns a shard of the
same buffers), and they call no ``torch.distributed`` collective themselves: every
collective they launch goes through :mod:`megalite.parallel.collectives`.
"""
