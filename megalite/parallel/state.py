"""Process groups of a parallel layout, built once and passed explicitly.

Rank order follows Megatron-LM: within the world, tensor parallel (tp) varies fastest,
then context parallel (cp), then data parallel (dp), then pipeline parallel (pp)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert layers re-carve each pipeline stage's ``tp * cp * dp`` ranks as expert tensor
parallel (etp, fastest), expert parallel (ep), then expert data parallel (edp)::

    index_in_stage = etp_rank + etp * (ep_rank + ep * edp_rank)

:func:`rank_groups` computes every group as lists of global ranks (pure, no torch);
:class:`ParallelState` creates the ``torch.distributed`` groups from them and answers
rank queries. Nothing here is a module global: pass the state to whatever needs it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.config import ParallelConfig
from megalite.config.parallel import (
    data_parallel_size,
    expert_data_parallel_size,
    is_v_schedule,
)
from megalite.parallel.device import DeviceSetupError, select_backend, select_device
from megalite.parallel.network import worker_check
from megalite.parallel.rendezvous import attempt_store, uses_agent_store

GROUP_NAMES = ("tp", "cp", "dp", "dp_cp", "pp", "mp", "tp_cp", "ep", "etp", "edp",
               "embedding", "position_embedding")


def _cartesian(sizes: dict[str, int], order: tuple[str, ...]) -> list[dict[str, int]]:
    """Coordinates of every rank, ``order[0]`` varying fastest."""
    coords, total = [], 1
    for s in sizes.values():
        total *= s
    for r in range(total):
        c, rest = {}, r
        for name in order:
            c[name], rest = rest % sizes[name], rest // sizes[name]
        coords.append(c)
    return coords


def _groups_varying(coords: list[dict[str, int]], varying: tuple[str, ...]) -> list[list[int]]:
    """Partition ranks into groups that differ only in the ``varying`` coordinates."""
    groups: dict[tuple, list[int]] = {}
    for rank, c in enumerate(coords):
        key = tuple(sorted((k, v) for k, v in c.items() if k not in varying))
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


def rank_groups(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                etp: int | None = None, v_shape: bool = False) -> dict[str, list[list[int]]]:
    """Every process group of the layout, as lists of global ranks.

    Returns a dict from group name (see ``GROUP_NAMES``) to the list of groups; every rank
    appears in exactly one group of each name. ``embedding`` holds the first and last
    pipeline stage of each pipeline group (with ``v_shape``, ZB-V's placement, the first
    stage alone: it holds both), ``position_embedding`` the first stage only.
    """
    etp = tp if etp is None else etp
    dp = data_parallel_size(world_size, tp, pp, cp)
    edp = expert_data_parallel_size(tp, cp, dp, ep, etp)

    dense_coords = _cartesian({"tp": tp, "cp": cp, "dp": dp, "pp": pp},
                              ("tp", "cp", "dp", "pp"))
    groups = {
        "tp": _groups_varying(dense_coords, ("tp",)),
        "cp": _groups_varying(dense_coords, ("cp",)),
        "dp": _groups_varying(dense_coords, ("dp",)),
        "dp_cp": _groups_varying(dense_coords, ("dp", "cp")),
        "pp": _groups_varying(dense_coords, ("pp",)),
        "mp": _groups_varying(dense_coords, ("tp", "pp")),
        "tp_cp": _groups_varying(dense_coords, ("tp", "cp")),
    }
    expert_coords = _cartesian({"etp": etp, "ep": ep, "edp": edp, "pp": pp},
                               ("etp", "ep", "edp", "pp"))
    groups["etp"] = _groups_varying(expert_coords, ("etp",))
    groups["ep"] = _groups_varying(expert_coords, ("ep",))
    groups["edp"] = _groups_varying(expert_coords, ("edp",))
    groups["embedding"] = [sorted({g[0], g[0] if v_shape else g[-1]}) for g in groups["pp"]]
    groups["position_embedding"] = [[g[0]] for g in groups["pp"]]
    return groups


@dataclass
class Group:
    """One process group as seen from this rank.

    ``group`` is the ``torch.distributed`` group, or None when torch.distributed is not
    initialized (world size 1): collectives must short-circuit when ``size == 1``.
    ``member`` is False for ranks outside every group of this kind (only possible for
    ``embedding`` / ``position_embedding``: middle pipeline stages).
    """

    name: str
    ranks: list[int]
    rank: int
    group: dist.ProcessGroup | None = None
    member: bool = True

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelState:
    """Process groups and rank queries of one parallel layout.

    Attributes are :class:`Group` objects: ``tp, cp, dp, dp_cp, pp, mp, tp_cp, ep, etp,
    edp, embedding, position_embedding``. ``dp`` is data parallel without context
    parallel; gradients of dense parameters are reduced over ``dp_cp``, of expert
    parameters over ``edp``.
    """

    world_size: int
    rank: int
    device: torch.device
    vpp_size: int | None
    v_shape: bool = False   # ZB-V's placement: chunk 1 runs back up, rank 0 holds the loss
    tp: Group = field(repr=False, default=None)
    cp: Group = field(repr=False, default=None)
    dp: Group = field(repr=False, default=None)
    dp_cp: Group = field(repr=False, default=None)
    pp: Group = field(repr=False, default=None)
    mp: Group = field(repr=False, default=None)
    tp_cp: Group = field(repr=False, default=None)
    ep: Group = field(repr=False, default=None)
    etp: Group = field(repr=False, default=None)
    edp: Group = field(repr=False, default=None)
    embedding: Group = field(repr=False, default=None)
    position_embedding: Group = field(repr=False, default=None)
    _owned: list = field(repr=False, default_factory=list)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, pcfg: ParallelConfig, device: torch.device | None = None,
              timeout_minutes: float | None = None) -> ParallelState:
        """Create every group for ``pcfg`` on the current world; ``device`` defaults to
        ``select_device(pcfg.device)`` (``--device``, :mod:`megalite.parallel.device`).

        torch.distributed must be initialized unless the world is one process. Every rank
        must call this collectively (groups are created in the same order everywhere).
        """
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        pcfg.data_parallel_size(world)  # clear error when the layout does not divide
        v_shape = is_v_schedule(pcfg.pipeline_schedule)
        layout = rank_groups(world, pcfg.tensor_model_parallel_size,
                             pcfg.pipeline_model_parallel_size, pcfg.context_parallel_size,
                             pcfg.expert_model_parallel_size, pcfg.expert_tensor_parallel_size,
                             v_shape)
        if device is None:
            device = select_device(pcfg.device)
        vpp = pcfg.virtual_pipeline_model_parallel_size or (2 if v_shape else None)
        state = cls(world_size=world, rank=rank, device=device, vpp_size=vpp,
                    v_shape=v_shape)
        minutes = timeout_minutes or pcfg.distributed_timeout_minutes
        for name in GROUP_NAMES:
            mine = None
            for ranks in layout[name]:
                pg = None
                if initialized and world > 1:
                    pg = dist.new_group(ranks, timeout=datetime.timedelta(minutes=minutes))
                    state._owned.append(pg)
                if rank in ranks:
                    mine = Group(name, ranks, ranks.index(rank), pg)
            if mine is None:  # a middle pipeline stage has no embedding group
                mine = Group(name, [rank], 0, None, member=False)
            setattr(state, name, mine)
        return state

    def destroy(self) -> None:
        """Destroy the groups this state created (the world group stays)."""
        for pg in self._owned:
            try:
                dist.destroy_process_group(pg)
            except (ValueError, RuntimeError):
                pass
        self._owned.clear()

    # -- queries ------------------------------------------------------------------------
    @property
    def num_model_chunks(self) -> int:
        """Model chunks per pipeline rank: the virtual pipeline size, or 1."""
        return self.vpp_size or 1

    def is_pipeline_first_stage(self, chunk: int | None = None) -> bool:
        """True on the first pipeline stage; with ``chunk``, only for that model chunk's
        piece of the model holding the embedding (chunk 0 of stage 0)."""
        if chunk is not None and chunk != 0:
            return False
        return self.pp.rank == 0

    def is_pipeline_last_stage(self, chunk: int | None = None) -> bool:
        """True on the last pipeline stage; with ``chunk``, only for the piece holding the
        output layer (the last chunk of the last stage). Under ZB-V's V placement
        (``v_shape``) that piece is chunk 1 of the first stage, which is then the last."""
        if chunk is not None and chunk != self.num_model_chunks - 1:
            return False
        return self.pp.rank == (0 if self.v_shape else self.pp.size - 1)

    def pipeline_neighbours(self) -> tuple[int, int]:
        """Global ranks of the previous and next pipeline stage (wrapping around)."""
        ranks, r = self.pp.ranks, self.pp.rank
        return ranks[(r - 1) % len(ranks)], ranks[(r + 1) % len(ranks)]

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp.rank}/{self.tp.size} "
                f"cp {self.cp.rank}/{self.cp.size} dp {self.dp.rank}/{self.dp.size} "
                f"pp {self.pp.rank}/{self.pp.size} ep {self.ep.rank}/{self.ep.size}")


def init_distributed(backend: str = "auto", timeout_minutes: float = 10,
                     device: str = "auto") -> tuple[int, int]:
    """Initialize torch.distributed from torchrun's environment if present.

    Without ``WORLD_SIZE`` in the environment (plain ``python script.py``) nothing is
    initialized and (rank, world) = (0, 1). ``device`` is ``--device`` and ``backend``
    ``--distributed-backend`` (``auto``: nccl on a CUDA device, else gloo); both are
    resolved by :mod:`megalite.parallel.device`, which raises
    :class:`~megalite.parallel.device.DeviceSetupError` before any process group exists
    when they cannot run here (more ranks than GPUs, nccl without CUDA), as it does for a
    gloo job across hosts whose host name resolves to loopback
    (:func:`megalite.parallel.network.worker_check`). On CUDA the rank's GPU becomes the
    current device. Returns (rank, world_size).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    chosen = select_device(device)
    backend = select_backend(backend, chosen, device)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    trap = worker_check() if backend == "gloo" else None
    if trap is not None:   # before the process group: it would hang for the whole timeout
        raise DeviceSetupError(trap)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if uses_agent_store():   # torchrun: a store of this attempt, not the one restarts share
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=attempt_store(rank, timeout),
                                rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
