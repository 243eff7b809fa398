"""``pretrain_gpt.py --dry-run --world-size N --rank R``: one rank of a layout at scale,
checked on a laptop in seconds.

In this process alone, pretending to be rank ``R`` of ``N``: validate every config rule
for ``N`` ranks; join a fake process group (``torch.distributed``'s ``fake`` backend:
collectives return at once, no peers) and build the ParallelState's groups; build rank
``R``'s model chunks on the ``meta`` device (shapes and parameters, no storage); check
the parameter count against the planner's count from the config (and under Muon its
matrices' elements); walk one step of the
pipeline schedule of every pipeline rank and match their transfers
(:func:`megalite.pipeline.plan.plan_rounds`), without data or math; print rank ``R``'s
coordinates, parameters and the planner's memory estimate
(:func:`megalite.planner.memory.estimate_memory`).
"""

from __future__ import annotations

import time

import torch


def dry_run(cfg, world_size: int, rank: int) -> str:
    """The report of rank ``rank`` of ``cfg`` on ``world_size`` ranks; raises ConfigError
    (or the builder's error) on a layout that cannot run."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megalite.config import ConfigError
    from megalite.config.layout import resolve_layout
    from megalite.parallel.state import ParallelState
    from megalite.pipeline.plan import pairs_of, plan_rounds
    from megalite.pipeline.schedules import layout_schedules
    from megalite.planner.memory import estimate_memory, stage_param_counts
    from megalite.training.build import default_model_provider

    start = time.perf_counter()
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank ({rank}) must be in [0, --world-size ({world_size}))")
    cfg.validate(world_size)
    if cfg.model.vocab_size is None:
        from megalite.data.tokenizers import build_tokenizer

        cfg.model.vocab_size = build_tokenizer(cfg.data).vocab_size
    layout = resolve_layout(cfg, world_size)
    if dist.is_initialized():
        raise RuntimeError("--dry-run needs a process without torch.distributed initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    real_new_group = dist.new_group

    def own_groups_only(ranks, **kwargs):
        # a real job creates every group on every rank; a lone rank needs only its own
        # (thousands of fake groups at N = 1024 would take minutes)
        if rank not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        return real_new_group(ranks, use_local_synchronization=True, **kwargs)

    dist.new_group = own_groups_only
    try:
        ps = ParallelState.build(cfg.parallel, device=torch.device("meta"))
        model = default_model_provider(cfg, ps)   # meta parameters: nothing is drawn
        params = {id(p): p for p in model.parameters()}
        n_params = sum(p.numel() for p in params.values())
        p = cfg.parallel
        dense, expert = stage_param_counts(cfg.model, p, ps.pp.rank)
        if n_params != dense + expert:
            raise AssertionError(f"rank {rank} built {n_params:,} parameters, the planner "
                                 f"counts {dense + expert:,} from the config")
        _check_rule_elements(cfg, layout, model, ps.pp.rank, rank)
        steps = layout_schedules(layout)
        pairs = (pairs_of(steps, layout.vpp, layout.v_shape)
                 if p.overlap_moe_expert_parallel_comm else None)   # as run_schedule plans
        rounds = plan_rounds(steps, layout.vpp, layout.v_shape, pairs)
        mem = estimate_memory(cfg, world_size, ps.pp.rank)
        coords = ps.describe()
        ps.destroy()
    finally:
        dist.new_group = real_new_group
        dist.destroy_process_group()
    gib = 2.0 ** 30
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in mem.as_dict().items() if k != "total")
    return "\n".join([
        f"dry run: rank {rank} of {world_size} | {coords}",
        f"  config: valid for {world_size} ranks: {layout.describe()} per step",
        f"  parameters on this rank: {n_params:,} (dense {dense:,}, experts {expert:,}; "
        f"built on the meta device)",
        f"  pipeline schedule {layout.pipeline_schedule}: "
        f"{len(steps[ps_pp_rank(coords)])} steps on this rank, "
        f"{len(rounds[0]) if rounds else 0} transfer rounds matched over "
        f"{layout.pp} stages; {mem.in_flight} micro-batch chunks "
        f"in flight at the peak",
        f"  estimated peak memory: {mem.total / gib:.2f} GiB ({parts})",
        f"  took {time.perf_counter() - start:.1f} s",
    ])


def _check_rule_elements(cfg, layout, model, pp_rank: int, rank: int) -> None:
    """Under an optimizer of two update rules, the elements of the parameters its main rule
    steps on this rank (Muon's matrices, Lion's linear weights; dense, expert) are those
    the planner counts from the config (:func:`megalite.planner.muon.stage_elements`)."""
    from megalite.optim.algorithms import algorithm_of
    from megalite.parallel.params import param_meta
    from megalite.planner.muon import stage_elements

    o = cfg.optim
    algorithm = algorithm_of(o)
    rules = algorithm.rules(o)
    if len(rules) < 2:
        return
    built = [0, 0]
    for name, p in model.named_parameters():
        if algorithm.rule(o, name, p) == rules[0]:
            built[1 if param_meta(p).expert else 0] += p.numel()
    counted = stage_elements(cfg, layout, pp_rank, lion=not algorithm.orthogonal)
    if tuple(built) != counted:
        raise AssertionError(f"rank {rank} built {rules[0]} parameters of {built[0]:,} dense "
                             f"and {built[1]:,} expert elements, the planner counts "
                             f"{counted[0]:,} and {counted[1]:,} from the config")


def ps_pp_rank(coords: str) -> int:
    """The pipeline rank from ParallelState.describe()'s ``pp r/n``."""
    return int(coords.split("pp ")[1].split("/")[0])


def split_dry_run_flags(argv: list[str]) -> tuple[list[str], tuple[int, int] | None]:
    """(``argv`` without ``--dry-run``, ``--world-size N``, ``--rank R``; ``(N, R)`` when
    ``--dry-run`` was given, else None). ``--world-size`` defaults to the layout's model
    parallel size would be ambiguous, so it is required; ``--rank`` defaults to 0."""
    from megalite.config import ConfigError

    rest, dry, world, rank = [], False, None, 0
    i = 0
    while i < len(argv):
        a = argv[i]
        key, eq, val = a.partition("=")
        if key == "--dry-run":
            dry = True
        elif key in ("--world-size", "--rank"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{key} needs a value")
                i += 1
                val = argv[i]
            try:
                n = int(val)
            except ValueError:
                raise ConfigError(f"{key} must be an integer, got {val!r}") from None
            if key == "--world-size":
                world = n
            else:
                rank = n
        else:
            rest.append(a)
        i += 1
    if not dry:
        if world is not None:
            raise ConfigError("--world-size is for --dry-run (a real run takes the world "
                              "from torchrun)")
        return rest, None
    if world is None or world < 1:
        raise ConfigError("--dry-run needs --world-size N (the ranks of the layout to check)")
    return rest, (world, rank)
