"""What a row of the layout table (:mod:`tests.layouts`) is and how a suite runs one: the
:class:`Layout` dataclass, the short names the table uses for ``ParallelConfig`` fields
(:data:`SHORT`), the derived row names (:func:`slug`, :func:`row`), and a row's config
(:func:`parallel_config`, :func:`tiny`) and pooled multi-rank run (:func:`run_by_world`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from megalite.config.parallel import data_parallel_size

# short names used in the table -> ParallelConfig fields, in the order names list them
SHORT = {"tp": "tensor_model_parallel_size", "sp": "sequence_parallel",
         "pp": "pipeline_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size",
         "schedule": "pipeline_schedule",
         "first": "decoder_first_pipeline_num_layers",
         "last": "decoder_last_pipeline_num_layers", "cp": "context_parallel_size",
         "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
         "distopt": "use_distributed_optimizer", "overlap_grad": "overlap_grad_reduce",
         "overlap_param": "overlap_param_gather", "bucket": "ddp_bucket_size",
         "strategy": "data_parallel_sharding_strategy",
         "a2a_overlap": "overlap_moe_expert_parallel_comm",
         "delay_wgrad": "delay_wgrad_compute"}
_FLAG_NAMES = {"sp": "sp", "distopt": "distopt", "overlap_grad": "ogr", "overlap_param": "opg",
               "a2a_overlap": "a2aov", "delay_wgrad": "dwg"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row: ``parallel`` holds ParallelConfig fields, ``model`` / ``train`` / ``optim`` /
    ``data`` config overrides (applied over the suite's own settings)."""

    name: str
    world_size: int
    parallel: dict = dataclasses.field(default_factory=dict)
    model: dict = dataclasses.field(default_factory=dict)
    train: dict = dataclasses.field(default_factory=dict)
    tags: tuple = ()
    optim: dict = dataclasses.field(default_factory=dict)
    data: dict = dataclasses.field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def get(self, short: str) -> Any:
        """A parallel field by its short name (``layout.get("tp")``), as ParallelConfig
        resolves it: defaults filled in (etp = tp), sequence parallel off at tp 1."""
        return getattr(parallel_config(self), SHORT[short])

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (tp x pp x cp)."""
        return parallel_config(self).data_parallel_size(self.world_size)


def slug(world_size: int, parallel: dict) -> str:
    """``tp2-sp-pp2-dp2-distopt``: the sizes above 1 (dp derived), then the flags set."""
    short = {s: parallel[f] for s, f in SHORT.items() if f in parallel}
    parts = []
    for s, value in short.items():
        if s in _FLAG_NAMES:
            parts += [_FLAG_NAMES[s]] if value else []
        elif s in ("strategy", "schedule"):
            parts.append(value)
        elif s != "bucket" and value is not None and (value > 1 or s in ("etp", "first",
                                                                          "last")):
            parts.append(f"{s}{value}")
    dp = data_parallel_size(world_size, *(short.get(s, 1) for s in ("tp", "pp", "cp")))
    if dp > 1:  # after the model-parallel sizes, before the expert sizes
        at = next((i for i, p in enumerate(parts) if p.startswith(("ep", "etp", "distopt",
                                                                   "ogr", "opg", "optim",
                                                                   "no_shard"))), len(parts))
        parts.insert(at, f"dp{dp}")
    return "-".join(parts) or "single"


def row(suite: str, world_size: int, variant: str = "", *, model: dict | None = None,
        train: dict | None = None, tags: Iterable[str] = (), data: dict | None = None,
        optim: dict | None = None, **short: Any) -> Layout:
    """A table row; ``short`` uses the keys of :data:`SHORT` (``tp=2, sp=True``)."""
    parallel = {SHORT[k]: v for k, v in short.items()}
    name = "-".join(p for p in (suite, slug(world_size, parallel), variant) if p)
    return Layout(name, world_size, parallel, dict(model or {}), dict(train or {}),
                  (suite, *tags), optim=dict(optim or {}), data=dict(data or {}))


def parallel_config(lay: Layout):
    """The row's ``ParallelConfig``."""
    from megalite.config import ParallelConfig

    return ParallelConfig(**lay.parallel)


def tiny(lay: Layout, world_size: int | None = None, *, model: dict | None = None,
         parallel: dict | None = None, train: dict | None = None, optim: dict | None = None,
         data: dict | None = None, **sections):
    """``tests.training.common.tiny_config`` for this row, validated for ``world_size``
    (default: the row's): the suite's ``model`` / ``parallel`` / ``train`` / ``optim``
    settings with the row's over them; other ``sections`` as given."""
    from tests.training.common import tiny_config

    return tiny_config(lay.world_size if world_size is None else world_size,
                       model={**(model or {}), **lay.model},
                       parallel={**(parallel or {}), **lay.parallel},
                       train={**(train or {}), **lay.train},
                       optim={**(optim or {}), **lay.optim},
                       data={**(data or {}), **lay.data}, **sections)


def run_by_world(rows: Iterable[Layout], body: Callable, *args: Any, **kwargs: Any):
    """Lazily run ``body(rank, world_size, rows_of_that_world, *args)`` once per world size
    on pooled ranks; ``body`` returns a list aligned with its rows. Returns a function
    ``results(layout) -> [that row's result on rank 0, 1, ...]`` (an error of a world's run
    is raised again for each of its rows)."""
    from tests.distributed.harness import run_distributed

    rows = list(rows)
    done: dict[str, list] = {}
    failed: dict[int, BaseException] = {}

    def results(lay: Layout) -> list:
        world = lay.world_size
        if world in failed:
            raise failed[world]
        if lay.name not in done:
            group = [r for r in rows if r.world_size == world]
            try:
                per_rank = run_distributed(world, body, group, *args, **kwargs)
            except BaseException as e:
                failed[world] = e
                raise
            for n, r in enumerate(group):
                done[r.name] = [out[n] for out in per_rank]
        return done[lay.name]

    return results
