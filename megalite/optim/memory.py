"""Bytes of parameters, gradients and optimizer state that this rank actually holds.

Measured, not computed from shapes: the storages behind the tensors (each counted once,
however many views point into it). A storage already counted as parameters is not counted
again as optimizer state (fp32 training with the distributed optimizer uses the model's
own parameter shard as the master), nor one counted as gradients.

Megatron-LM's accounting for Adam with bf16 parameters and fp32 gradients, per parameter
of this rank's model-parallel slice: 2 bytes of parameter, 4 of gradient, and 12 of
optimizer state (fp32 master + two fp32 moments), divided by the data-parallel size ``D``
under the distributed optimizer: :func:`expected_optimizer_bytes`. With
``--data-parallel-sharding-strategy optim_grads`` the gradients between steps are
``4 / D`` too (:func:`expected_bytes_per_param`), and with ``optim_grads_params`` the
parameters as well (their persistent shards; the full copies gathered for a layer's
forward or backward are freed between steps); ``--optimizer-cpu-offload`` moves a
fraction of the optimizer bytes (plus an fp32 gradient copy) to host memory, counted in
``RankMemory.offloaded``, not in ``optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config.parallel import SHARDING_STRATEGIES
from megalite.pipeline.layout import model_chunks


@dataclass
class RankMemory:
    """Bytes held by this rank; ``num_params``: parameter elements of this rank's slice."""

    params: int
    grads: int
    optimizer: int
    num_params: int
    offloaded: int = 0     # optimizer bytes in host memory (--optimizer-cpu-offload)

    def describe(self) -> str:
        mib = 2.0 ** 20
        return (f"memory on this rank: params {self.params / mib:.2f} MiB | grads "
                f"{self.grads / mib:.2f} MiB | optimizer {self.optimizer / mib:.2f} MiB "
                f"({self.num_params:,} parameters)"
                + (f" | offloaded to host {self.offloaded / mib:.2f} MiB"
                   if self.offloaded else ""))


def _storages(tensors, exclude: dict | None = None) -> dict[int, int]:
    """data pointer -> bytes of the distinct storages behind ``tensors``."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if exclude is None or key not in exclude:
            out[key] = st.nbytes()
    return out


def rank_memory(model, grads, optimizer) -> RankMemory:
    """Measure ``model`` (Module or chunks), its DataParallelGrads and its optimizer."""
    params = []
    for chunk in model_chunks(model):
        params += list(chunk.parameters()) if isinstance(chunk, torch.nn.Module) else chunk
    unique = list({id(p): p for p in params}.values())
    p_st = _storages(unique + getattr(grads, "param_memory_tensors", list)())
    g_st = _storages(grads.memory_tensors() + [p.grad for p in unique], p_st)
    o_st = _storages(optimizer.memory_tensors(), {**p_st, **g_st})
    h_st = _storages(getattr(optimizer, "offloaded_tensors", list)(), {**p_st, **g_st, **o_st})
    return RankMemory(params=sum(p_st.values()), grads=sum(g_st.values()),
                      optimizer=sum(o_st.values()),
                      num_params=sum(p.numel() for p in unique), offloaded=sum(h_st.values()))


def expected_optimizer_bytes(num_params: int, dp: int, distributed: bool,
                             half: bool = True) -> float:
    """Adam: fp32 master (only with half-precision parameters) + two fp32 moments per
    parameter, divided by ``dp`` under the distributed optimizer."""
    per_param = (12 if half else 8) / (dp if distributed else 1)
    return per_param * num_params


def expected_bytes_per_param(strategy: str, dp: int, param_bytes: int = 2,
                             grad_bytes: int = 4, optim_bytes: int = 12) -> dict[str, float]:
    """ZeRO's accounting per parameter of this rank's slice, between steps, for a
    ``--data-parallel-sharding-strategy``: ``params`` (divided by ``dp`` under
    optim_grads_params), ``grads`` (divided by ``dp`` under optim_grads and
    optim_grads_params) and ``optimizer`` (divided by ``dp`` under all but no_shard).
    Defaults: bf16 parameters, fp32 gradients, Adam with fp32 masters. Not included: the
    gathered layer's transient copy under optim_grads_params."""
    if strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; one of "
                         f"{SHARDING_STRATEGIES}")
    return {"params": param_bytes / (dp if strategy == "optim_grads_params" else 1),
            "grads": grad_bytes / (dp if strategy in ("optim_grads", "optim_grads_params")
                                   else 1),
            "optimizer": optim_bytes / (1 if strategy == "no_shard" else dp)}
