"""Enumerate layouts for a model on a cluster, keep the legal ones that fit, rank by time.

A candidate sets tp x pp x vpp x cp x ep (dp is what is left of the world), the
pipeline schedule (1F1B or ZB-H1 with one chunk per rank, interleaved 1F1B with more, ZB-V
and DualPipeV with two in a V), the
data-parallel sharding strategy, recomputation and the micro-batch size on a copy of the
user's config; megalite's own validation (``MegaliteConfig.validate``, which calls
``ModelConfig.check_layout``) decides whether it is legal, so the planner never proposes a
layout the code refuses. A legal layout whose estimated peak memory exceeds the GPU's is
infeasible, with the limit it breaks.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

from megalite.config import ConfigError
from megalite.config.parallel import SHARDING_STRATEGIES, data_parallel_size
from megalite.planner.cluster import GIB, Cluster
from megalite.planner.memory import MemoryEstimate, estimate_memory
from megalite.planner.time import TimeEstimate, estimate_time

RECOMPUTE = {"none": {"recompute_granularity": None, "recompute_method": None,
                      "recompute_num_layers": None, "recompute_modules": None},
             "selective": {"recompute_granularity": "selective", "recompute_method": None,
                           "recompute_num_layers": None, "recompute_modules": None},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                      "recompute_num_layers": 1, "recompute_modules": None}}
# --data-parallel-sharding-strategy values the planner proposes: all of them
STRATEGIES = SHARDING_STRATEGIES
# --pipeline-schedule values the planner proposes: 1f1b and zb_h1 with one chunk per
# pipeline rank, zbv and dualpipev with two (beside interleaved_1f1b, which every vpp > 1
# runs); megalite's validation keeps dualpipev to m >= 2 pp
SCHEDULES = ("1f1b", "zb_h1", "zbv", "dualpipev")
ONE_CHUNK_SCHEDULES = ("1f1b", "zb_h1")
V_SCHEDULES = ("zbv", "dualpipev")
NAMED_SCHEDULES = ("zb_h1", *V_SCHEDULES)   # named in a candidate and its flags


def schedules_for(pp: int, vpp: int, schedules=SCHEDULES) -> tuple:
    """The ``--pipeline-schedule`` values to try at ``pp`` x ``vpp`` (None: the default by
    vpp): the one-chunk ones of ``schedules``, or the default (interleaved 1F1B) and, at
    vpp 2, the V schedules of ``schedules`` (ZB-V, DualPipeV)."""
    if pp == 1:
        return (None,)
    if vpp == 1:
        return tuple(s for s in schedules if s in ONE_CHUNK_SCHEDULES) or (None,)
    if vpp != 2:
        return (None,)
    return (None, *(s for s in V_SCHEDULES if s in schedules))


@dataclass
class Candidate:
    """One layout; ``error`` says which limit an infeasible one breaks."""

    sizes: dict                        # tp, pp, vpp, cp, ep, dp
    strategy: str
    recompute: str
    micro_batch_size: int
    offload: float = 0.0               # --optimizer-offload-fraction (0: no offload)
    overlap: bool = False              # --overlap-grad-reduce (and --overlap-param-gather
                                       # under a sharded strategy)
    schedule: str | None = None        # --pipeline-schedule (None: the default by vpp)
    cfg: object = None
    memory: MemoryEstimate | None = None
    time: TimeEstimate | None = None
    error: str | None = None
    notes: list = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.error is None

    def name(self) -> str:
        s = self.sizes
        parts = [f"tp{s['tp']}", f"pp{s['pp']}"]
        if s["vpp"] > 1:
            parts.append(f"vpp{s['vpp']}")
        if self.schedule in NAMED_SCHEDULES:
            parts.append(self.schedule)
        parts += [f"cp{s['cp']}"] if s["cp"] > 1 else []
        parts += [f"ep{s['ep']}"] if s["ep"] > 1 else []
        parts += [f"dp{s['dp']}", self.strategy + (f"+off{self.offload:g}" if self.offload
                                                   else ""),
                  f"rc-{self.recompute}", f"mbs{self.micro_batch_size}"]
        return " ".join(parts + (["overlap"] if self.overlap else []))

    def launch_flags(self) -> list[str]:
        """Megatron-style flags of this layout (to add to the model's own flags)."""
        s, flags = self.sizes, []
        flags += ["--tensor-model-parallel-size", str(s["tp"]),
                  "--pipeline-model-parallel-size", str(s["pp"])]
        if s["vpp"] > 1:
            flags += ["--virtual-pipeline-model-parallel-size", str(s["vpp"])]
        if self.schedule in NAMED_SCHEDULES:
            flags += ["--pipeline-schedule", self.schedule]
        if s["tp"] > 1:
            flags.append("--sequence-parallel")
        if s["cp"] > 1:
            flags += ["--context-parallel-size", str(s["cp"])]
        if s["ep"] > 1:
            flags += ["--expert-model-parallel-size", str(s["ep"])]
        if self.strategy == "optim":
            flags.append("--use-distributed-optimizer")
        elif self.strategy != "no_shard":
            flags += ["--data-parallel-sharding-strategy", self.strategy]
        if self.offload:
            flags += ["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                      f"{self.offload:g}"]
        if self.overlap:
            flags.append("--overlap-grad-reduce")
            if self.strategy != "no_shard":
                flags.append("--overlap-param-gather")
        if self.recompute != "none":
            flags += ["--recompute-granularity", self.recompute]
            if self.recompute == "full":
                flags += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
        flags += ["--micro-batch-size", str(self.micro_batch_size)]
        return flags


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_config(base, world: int, sizes: dict, strategy: str, recompute: str, mbs: int,
                offload: float = 0.0, overlap: bool = False, schedule: str | None = None):
    """A validated copy of ``base`` with the layout applied (raises ConfigError)."""
    cfg = copy.deepcopy(base)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    p.pipeline_schedule = schedule
    p.overlap_grad_reduce = overlap
    p.overlap_param_gather = overlap and strategy != "no_shard"
    cfg.optim.optimizer_cpu_offload = offload > 0
    cfg.optim.optimizer_offload_fraction = offload if offload > 0 else 1.0
    p.tensor_model_parallel_size = sizes["tp"]
    p.pipeline_model_parallel_size = sizes["pp"]
    p.virtual_pipeline_model_parallel_size = sizes["vpp"] if sizes["vpp"] > 1 else None
    p.num_layers_per_virtual_pipeline_stage = None
    p.context_parallel_size = sizes["cp"]
    p.expert_model_parallel_size = sizes["ep"]
    p.expert_tensor_parallel_size = sizes["tp"]
    p.sequence_parallel = sizes["tp"] > 1
    p.data_parallel_sharding_strategy = strategy
    p.use_distributed_optimizer = strategy != "no_shard"
    for k, v in RECOMPUTE[recompute].items():
        setattr(m, k, v)
    t.micro_batch_size = mbs
    type(p).__post_init__(p)
    type(m).__post_init__(m)
    return cfg.validate(world)


def evaluate(base, world: int, cluster: Cluster, sizes: dict, strategy: str,
             recompute: str, mbs: int, offload: float = 0.0,
             overlap: bool = False, schedule: str | None = None) -> Candidate:
    """One candidate: validated, its memory and time estimated, feasibility decided."""
    c = Candidate(dict(sizes), strategy, recompute, mbs, offload, overlap, schedule)
    try:
        c.cfg = make_config(base, world, sizes, strategy, recompute, mbs, offload, overlap,
                            schedule)
    except (ConfigError, ValueError) as e:
        c.error = f"config: {e}"
        return c
    c.memory = estimate_memory(c.cfg, world)
    c.time = estimate_time(c.cfg, world, cluster)
    budget = cluster.gpu_memory * cluster.memory_margin
    if c.memory.total > budget:
        c.error = (f"memory: {c.memory.total / GIB:.1f} GiB per rank > {budget / GIB:.1f} "
                   f"GiB ({cluster.memory_margin:.0%} of {cluster.gpu_memory / GIB:.0f} GiB)")
    return c


def search(base, cluster: Cluster, *, tp=None, pp=None, vpp=None, cp=None, ep=None,
           strategies=STRATEGIES, recomputes=tuple(RECOMPUTE), micro_batch_sizes=(1, 2, 4, 8),
           offloads=(0.0, 1.0), overlaps=(False, True),
           schedules=SCHEDULES, progress: bool = False) -> list[Candidate]:
    """Every candidate for ``base`` (a MegaliteConfig: model, global batch, precision) on
    ``cluster``: feasible ones first, by estimated step time, then the infeasible ones.
    Size lists default to the divisors that can work (tp within a node); ``offloads``:
    ``--optimizer-offload-fraction`` values to try (0: none; offload needs a sharded
    strategy); ``overlaps``: with and without ``--overlap-grad-reduce`` (and
    ``--overlap-param-gather`` under a sharded strategy), the user's own overlap flags set
    aside (tried only where there is data parallelism to overlap); ``schedules``: the
    pipeline schedules tried where pp > 1 (of :data:`SCHEDULES`: :func:`schedules_for`;
    several chunks run interleaved 1F1B, two also ZB-V and DualPipeV). ``progress``: count
    the candidates evaluated on stderr (:mod:`megalite.progress`)."""
    m = base.model
    world = cluster.world_size
    tps = tp or [d for d in _divisors(world) if d <= cluster.gpus_per_node and d & (d - 1) == 0]
    pps = pp or [d for d in _divisors(m.num_layers) if world % d == 0]
    vpps = vpp or [1, 2, 4]
    cps = cp or ([1, 2, 4, 8] if m.seq_length >= 16384 else [1, 2] if m.seq_length >= 8192
                 else [1])
    eps = ep or (_divisors(m.num_experts) if m.num_experts else [1])
    todo = []
    for t_, p_, v_, c_, e_ in itertools.product(tps, pps, vpps, cps, eps):
        if world % (t_ * p_ * c_) or (v_ > 1 and p_ == 1):
            continue
        if (m.num_layers // p_) % v_:
            continue
        sizes = {"tp": t_, "pp": p_, "vpp": v_, "cp": c_, "ep": e_,
                 "dp": data_parallel_size(world, t_, p_, c_)}
        scheds = schedules_for(p_, v_, schedules)
        for strategy, rc, mbs, off, ov, sched in itertools.product(
                strategies, recomputes, micro_batch_sizes, offloads, overlaps, scheds):
            if strategy != "no_shard" and sizes["dp"] * c_ == 1:
                continue  # nothing to shard
            if off and strategy == "no_shard":
                continue  # offload moves the distributed optimizer's shard
            if ov and sizes["dp"] * c_ == 1 and len(overlaps) > 1:
                continue  # nothing to overlap: the same candidate as without
            todo.append((sizes, strategy, rc, mbs, off, ov,
                         None if sched == "1f1b" else sched))
    from megalite.progress import Progress

    out = [evaluate(base, world, cluster, *one) for one in
           Progress(desc="plan", unit="layout", iterable=todo, disable=not progress)]
    out.sort(key=lambda c: (not c.feasible, c.time.step if c.time else float("inf"),
                            c.memory.total if c.memory else float("inf")))  # ties: less memory
    return out
