"""Grouped GEMM vs the per-expert loop, index helpers, init and parameter attributes."""

import types

import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.moe.comm import sort_chunks_index
from megalite.moe.dispatcher import permute, unpermute
from megalite.moe.experts import GroupedMLP, grouped_mlp, padded_index
from megalite.parallel.params import is_expert_param, param_meta
from megalite.parallel.state import Group, ParallelState
from tests.moe.reference import expert_loop


def _rand(seed, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("swiglu, bias, counts", [
    (True, False, [3, 0, 5, 1]),    # an expert without tokens
    (False, True, [2, 2, 2, 2]),
    (True, True, [0, 0, 7, 0]),
    (False, False, [0, 0, 0, 0]),   # no tokens at all
])
def test_grouped_gemm_matches_per_expert_loop(swiglu, bias, counts):
    E, h, f = 4, 6, 5
    f1 = 2 * f if swiglu else f
    counts = torch.tensor(counts)
    M = int(counts.sum())
    x = _rand(0, M, h).requires_grad_(True)
    params = [_rand(1, E, h, f1), _rand(2, E, f, h)]
    if bias:
        params += [_rand(3, E, f1), _rand(4, E, h)]
    params = [p.requires_grad_(True) for p in params]
    grad = _rand(5, M, h)
    outs, grads = [], []
    for fn in (grouped_mlp, expert_loop):
        kw = {"swiglu": swiglu}
        if bias:
            kw.update(fc1_bias=params[2], fc2_bias=params[3])
        y = fn(x, counts, params[0], params[1], **kw)
        outs.append(y)
        if M:
            grads.append(torch.autograd.grad(y, [x, *params], grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads) if grads else []:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_padded_index():
    index, cap = padded_index(torch.tensor([2, 0, 3]))
    assert cap == 3 and index.tolist() == [0, 1, 6, 7, 8]


def test_sort_chunks_index_matches_loop():
    sizes = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source, expert]
    rows, start = {}, 0
    for a in range(2):
        for b in range(3):
            rows[(a, b)] = list(range(start, start + int(sizes[a, b])))
            start += int(sizes[a, b])
    want = [r for b in range(3) for a in range(2) for r in rows[(a, b)]]
    assert sort_chunks_index(sizes).tolist() == want


def test_permute_unpermute_round_trip():
    x = _rand(0, 5, 3)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 0, 0]]).bool()
    probs = _rand(1, 5, 3).abs() * routing_map
    tokens, index, p, counts = permute(x, probs, routing_map)
    assert counts.tolist() == [3, 2, 3]
    assert index.tolist() == [0, 2, 4, 1, 2, 0, 1, 3]  # expert-major, token order within
    torch.testing.assert_close(unpermute(tokens, index, p, 5), x * probs.sum(1, keepdim=True))


def _cfg(**kw):
    return ModelConfig(**{"hidden_size": 8, "num_experts": 4, "moe_router_topk": 2,
                          "moe_ffn_hidden_size": 6, "swiglu": True, "num_layers": 3, **kw})


def _etp_state(size: int = 1, rank: int = 0):
    """The part of a ParallelState a GroupedMLP reads: its etp group and device."""
    return types.SimpleNamespace(etp=Group("etp", list(range(size)), rank),
                                 device=torch.device("cpu"))


def test_expert_init_is_layout_invariant_and_params_are_marked():
    one = _etp_state()
    full = GroupedMLP(_cfg(), 4, 0, one)
    full.reset_parameters(7, "layers.2.mlp.experts")
    for first in (0, 2):  # ep = 2: each rank draws only its two experts
        half = GroupedMLP(_cfg(), 2, first, one)
        half.reset_parameters(7, "layers.2.mlp.experts")
        assert torch.equal(half.fc1, full.fc1[first:first + 2])
        assert torch.equal(half.fc2, full.fc2[first:first + 2])
    # etp = 2 keeps columns of gate and of up (fc1) and rows of fc2
    shards = []
    for r in range(2):
        g = GroupedMLP(_cfg(add_bias_linear=True), 4, 0, _etp_state(2, r))
        g.reset_parameters(7, "layers.2.mlp.experts")
        shards.append(g)
    gate, up = full.fc1.split(6, dim=2)
    assert torch.equal(shards[1].fc1, torch.cat([gate[..., 3:], up[..., 3:]], dim=2))
    assert torch.equal(shards[1].fc2, full.fc2[:, 3:])
    for p in (*full.parameters(), *shards[0].parameters()):
        assert param_meta(p).expert and is_expert_param(p)
    assert all(param_meta(p).first_expert == 2 for p in half.parameters())
    # marked sharded over etp at etp = 1 too: checkpoints keep gate and up apart
    assert param_meta(full.fc1).partition_dim == 2
    assert param_meta(full.fc1).partition_parts == (6, 6)
    assert param_meta(shards[0].fc1).partition_dim == 2
    assert param_meta(shards[0].fc2).partition_dim == 1
    assert param_meta(shards[0].fc2_bias).sequence_parallel
    assert param_meta(full.fc2).init_std < param_meta(full.fc1).init_std  # scaled output


def test_layer_init_names_and_router_attributes():
    from megalite.moe.layer import MoELayer

    ps = ParallelState.build(ParallelConfig())
    a = MoELayer(_cfg(moe_shared_expert_intermediate_size=4), ps, layer_number=5, seed=3)
    b = MoELayer(_cfg(moe_shared_expert_intermediate_size=4), ps, layer_number=5, seed=3)
    c = MoELayer(_cfg(moe_shared_expert_intermediate_size=4), ps, layer_number=6, seed=3)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert param_meta(pa).init_fill is not None or not torch.equal(pa, pc), name
    assert param_meta(a.router.weight).init_name == "layers.5.mlp.router.weight"
    assert param_meta(a.experts.fc1).init_name == "layers.5.mlp.experts.fc1"
    assert (param_meta(a.shared_experts.fc1.weight).init_name
            == "layers.5.mlp.shared_experts.fc1.weight")
    router = param_meta(a.router.weight)
    assert not router.expert and not router.sequence_parallel
    assert not any(param_meta(p).expert for p in a.shared_experts.parameters())
    # drawn once, when the layer was built; a redraw gives the same values
    before = [p.detach().clone() for p in a.parameters()]
    a.reset_parameters()
    assert all(torch.equal(x, p) for x, p in zip(before, a.parameters()))
