"""Autograd collectives on 2 and 4 gloo ranks against the single-rank math."""

import pytest
import torch

from megalite.parallel import mappings as M
from tests.distributed.harness import parallel_state, run_distributed

SHAPE = (8, 3, 12)  # [s, b, h]; s and h divisible by 2 and 4


def _full(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _cases(tp, r):
    """(name, fn, local input, upstream grad, expected output, expected input grad)."""
    X, Xs, G, Gs = _full(1, *SHAPE), _full(2, tp, *SHAPE), _full(3, *SHAPE), _full(4, tp, *SHAPE)
    last = lambda t: t.chunk(tp, dim=-1)[r]
    first = lambda t: t.chunk(tp, dim=0)[r]
    return [
        ("copy_tp", M.copy_to_tensor_model_parallel_region, X, Gs[r], X, Gs.sum(0)),
        ("reduce_tp", M.reduce_from_tensor_model_parallel_region, Xs[r], G, Xs.sum(0), G),
        ("scatter_tp", M.scatter_to_tensor_model_parallel_region, X, last(G), last(X), G),
        ("gather_tp", M.gather_from_tensor_model_parallel_region, last(X), G, X, last(G)),
        ("scatter_sp", M.scatter_to_sequence_parallel_region, X, first(G), first(X), G),
        ("gather_sp", M.gather_from_sequence_parallel_region, first(X), Gs[r], X,
         first(Gs.sum(0))),
        ("gather_sp_no_reduce",
         lambda x, g: M.gather_from_sequence_parallel_region(x, g, False),
         first(X), G, X, first(G)),
        ("reduce_scatter_sp", M.reduce_scatter_to_sequence_parallel_region, Xs[r], first(G),
         first(Xs.sum(0)), G),
    ]


def _body(rank, world_size):
    errors = {}
    with parallel_state(tensor_model_parallel_size=world_size) as ps:
        for name, fn, x, g, want_y, want_dx in _cases(world_size, ps.tp.rank):
            x = x.clone().requires_grad_(True)
            y = fn(x, ps.tp)
            y.backward(g)
            errors[name] = (y.shape == want_y.shape and x.grad.shape == want_dx.shape,
                            (y - want_y).abs().max().item(),
                            (x.grad - want_dx).abs().max().item())
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_match_single_rank_math(world):
    for rank, errors in enumerate(run_distributed(world, _body)):
        assert len(errors) == 8
        for name, (shapes_ok, fwd, bwd) in errors.items():
            assert shapes_ok, (rank, name)
            assert fwd < 1e-12 and bwd < 1e-12, (rank, name, fwd, bwd)


def test_mappings_are_identity_on_one_rank():
    from megalite.config import ParallelConfig
    from megalite.parallel.state import ParallelState

    ps = ParallelState.build(ParallelConfig())
    for name, fn, x, g, want_y, want_dx in _cases(1, 0):
        assert fn(x, ps.tp) is x, name


def _sp_grads_body(rank, world_size):
    from megalite.parallel.grads import allreduce_sequence_parallel_grads
    from megalite.parallel.params import mark_param

    with parallel_state(tensor_model_parallel_size=world_size) as ps:
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
        mark_param(a, init_fill=0.0, sequence_parallel=True)
        mark_param(b, init_fill=0.0, sequence_parallel=False)
        a.grad, b.grad = torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 1))
        allreduce_sequence_parallel_grads([a, b], ps.tp)
        return a.grad.tolist(), b.grad.tolist()


def test_allreduce_sequence_parallel_grads():
    out = run_distributed(2, _sp_grads_body)
    assert out[0] == ([3.0] * 3, [1.0] * 2) and out[1] == ([3.0] * 3, [2.0] * 2)
