"""Process-group layout: every rank's groups against an independent computation."""

import itertools

import pytest
import torch
import torch.distributed as dist

from megalite.config import ConfigError, ParallelConfig
from megalite.parallel.state import GROUP_NAMES, ParallelState, rank_groups
from tests.distributed.harness import parallel_state, run_distributed


def expected_groups(world, tp, pp, cp, ep, etp, r):
    """The groups of rank r from closed-form rank arithmetic (Megatron's order)."""
    dp = world // (tp * pp * cp)
    stage = tp * cp * dp
    tp_r, cp_r, dp_r, pp_r = r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // stage
    idx = r % stage
    etp_r, ep_r, edp_r = idx % etp, (idx // etp) % ep, idx // (etp * ep)
    edp = stage // (etp * ep)
    pp_group = [idx + k * stage for k in range(pp)]
    return {
        "tp": [r - tp_r + i for i in range(tp)],
        "cp": [tp_r + tp * (i + cp * (dp_r + dp * pp_r)) for i in range(cp)],
        "dp": [tp_r + tp * (cp_r + cp * (i + dp * pp_r)) for i in range(dp)],
        "dp_cp": [tp_r + tp * j + stage * pp_r for j in range(cp * dp)],
        "pp": pp_group,
        "mp": sorted(i + tp * (cp_r + cp * dp_r) + stage * k for k in range(pp) for i in range(tp)),
        "tp_cp": [tp * cp * (dp_r + dp * pp_r) + j for j in range(tp * cp)],
        "etp": [stage * pp_r + i + etp * (ep_r + ep * edp_r) for i in range(etp)],
        "ep": [stage * pp_r + etp_r + etp * (i + ep * edp_r) for i in range(ep)],
        "edp": [stage * pp_r + etp_r + etp * (ep_r + ep * i) for i in range(edp)],
        "embedding": sorted({pp_group[0], pp_group[-1]}),
        "position_embedding": [pp_group[0]],
    }


def layouts(world):
    out = []
    for tp, pp, cp in itertools.product([1, 2, 4, 8], repeat=3):
        if world % (tp * pp * cp):
            continue
        stage = world // pp
        for ep in (1, 2, 4, 8):
            for etp in {tp, 1}:
                if stage % (ep * etp) == 0:
                    out.append((tp, pp, cp, ep, etp))
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_rank_groups_match_independent_computation(world):
    for tp, pp, cp, ep, etp in layouts(world):
        groups = rank_groups(world, tp, pp, cp, ep, etp)
        for name in GROUP_NAMES:
            seen = sorted(r for g in groups[name] for r in g)
            if name in ("embedding", "position_embedding"):
                continue
            assert seen == list(range(world)), (name, tp, pp, cp, ep)
        for r in range(world):
            want = expected_groups(world, tp, pp, cp, ep, etp, r)
            for name in GROUP_NAMES:
                mine = [g for g in groups[name] if r in g]
                if name in ("embedding", "position_embedding") and r not in want[name]:
                    assert mine == []
                    continue
                assert mine == [want[name]], (name, r, (tp, pp, cp, ep, etp))


def test_megatron_documented_example():
    # 16 GPUs, tp=2, pp=4 (the example in Megatron-LM's parallel_state docstring)
    g = rank_groups(16, tp=2, pp=4)
    assert g["tp"][:3] == [[0, 1], [2, 3], [4, 5]]
    assert g["pp"][:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert g["dp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert g["embedding"][0] == [0, 12]


def test_layout_that_does_not_divide():
    with pytest.raises(ConfigError, match=r"world size \(6\) must be divisible"):
        rank_groups(6, tp=4)
    with pytest.raises(ConfigError, match="expert"):
        rank_groups(8, tp=2, ep=8)


def test_single_process_without_torch_distributed():
    assert not dist.is_initialized()
    ps = ParallelState.build(ParallelConfig())
    assert (ps.tp.size, ps.dp.size, ps.pp.size, ps.tp.group) == (1, 1, 1, None)
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()


LAYOUTS_8 = [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
             dict(tensor_model_parallel_size=2, context_parallel_size=2),
             dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
             dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
             dict(expert_model_parallel_size=4, expert_tensor_parallel_size=1,
                  tensor_model_parallel_size=2),
             dict(tensor_model_parallel_size=8)]


def _check_live_groups(rank, world_size, layouts):
    """Every created ProcessGroup reduces over exactly the expected ranks."""
    out = []
    for sizes in layouts:
        with parallel_state(**sizes) as ps:
            pcfg = ParallelConfig(**sizes)
            want = expected_groups(world_size, pcfg.tensor_model_parallel_size,
                                   pcfg.pipeline_model_parallel_size,
                                   pcfg.context_parallel_size,
                                   pcfg.expert_model_parallel_size,
                                   pcfg.expert_tensor_parallel_size, rank)
            for name in GROUP_NAMES:
                g = getattr(ps, name)
                if not g.member:
                    assert rank not in want[name]
                    continue
                assert g.ranks == want[name], (name, sizes)
                t = torch.tensor([float(rank)])
                if g.size > 1:
                    dist.all_reduce(t, group=g.group)
                assert t.item() == sum(want[name]), (name, sizes)
            out.append((ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                        ps.is_pipeline_first_stage(chunk=1)))
    return out


def test_live_groups_world_8():
    results = run_distributed(8, _check_live_groups, LAYOUTS_8)
    # pp=4 layout (index 2): ranks 0,1 are first stage, 6,7 last; chunk 1 is never first
    assert [r[2][0] for r in results] == [True, True] + [False] * 6
    assert [r[2][1] for r in results] == [False] * 6 + [True, True]
    assert not any(r[2][2] for r in results)


def test_live_groups_world_4_and_reinit():
    layouts4 = [dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2),
                dict(context_parallel_size=2, tensor_model_parallel_size=2)]
    for _ in range(2):  # destroy and re-create in the same processes
        run_distributed(4, _check_live_groups, layouts4)
