"""Tensor-parallel building blocks against their single-rank definitions (tp 1, 2, 4)."""

import pytest
import torch
import torch.nn.functional as F

from megalite.layers import sharding
from megalite.layers.cross_entropy import vocab_parallel_cross_entropy
from megalite.layers.embedding import VocabParallelEmbedding
from megalite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megalite.parallel import mappings
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import single_process_state

VOCAB, PADDED, S, B, H = 50, 64, 8, 2, 16


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cross_entropy_case(tp):
    """Vocab-parallel CE with huge padded logits and an ignored target vs F.cross_entropy."""
    full = _rand(1, S, B, PADDED)
    full[..., VOCAB:] = 50.0  # would dominate the softmax if padding were not masked
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(2))
    target[0, 0] = -100
    up = _rand(3, S, B)
    want = F.cross_entropy(full[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1),
                           reduction="none", ignore_index=-100).view(S, B)
    x = full[..., :VOCAB].clone().requires_grad_(True)
    F.cross_entropy(x.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                    ignore_index=-100).view(S, B).backward(up)
    want_grad = torch.cat([x.grad, torch.zeros(S, B, PADDED - VOCAB)], dim=-1)
    return full, target, up, want, want_grad


def _check_cross_entropy(group):
    full, target, up, want, want_grad = _cross_entropy_case(group.size)
    local = full.chunk(group.size, dim=-1)[group.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=VOCAB)
    loss.backward(up)
    grad = want_grad.chunk(group.size, dim=-1)[group.rank]
    return max((loss - want).abs().max().item(), (local.grad - grad).abs().max().item())


def _check_embedding(ps, sp):
    group = ps.tp
    emb = VocabParallelEmbedding(PADDED, H, vocab_size=VOCAB, ps=ps,
                                 sequence_parallel=sp, init_std=1.0)
    table = _rand(4, VOCAB, H)
    sharding.initialize_params(emb, 0, ps)
    with torch.no_grad():
        emb.weight.copy_(sharding.shard(table, emb.weight, group.size, group.rank))
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(5))
    want = F.embedding(ids, table)
    if sp:
        want = want.chunk(group.size, dim=0)[group.rank]
    return (emb(ids) - want).abs().max().item()


def _check_linear_pair(ps):
    """gather_output column layer, then a row layer splitting its full input itself."""
    group = ps.tp
    w1, w2, x = _rand(6, 24, H), _rand(7, H, 24), _rand(8, S, B, H).requires_grad_(True)
    col = ColumnParallelLinear(H, 24, ps=ps, bias=False, gather_output=True)
    row = RowParallelLinear(24, H, ps=ps, bias=False, input_is_parallel=False)
    with torch.no_grad():
        col.weight.copy_(sharding.shard(w1, col.weight, group.size, group.rank))
        row.weight.copy_(sharding.shard(w2, row.weight, group.size, group.rank))
    y = row(col(x))
    y.sum().backward()
    w1g = sharding.gather_full(col.weight.grad, col.weight, group)
    xr = x.detach().clone().requires_grad_(True)
    w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    yr = F.linear(F.linear(xr, w1r), w2r)
    yr.sum().backward()
    pairs = ((y, yr), (x.grad, xr.grad), (w1g, w1r.grad))
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)  # relative


def _check_sequence_parallel_column(ps, bias: bool) -> float:
    """The sequence-parallel column layer (keeps its ``[s/tp, b, h]`` input, gathers it
    again in backward) against all-gather + ``F.linear``: output and the input, weight
    and bias gradients bit for bit; 0.0 when equal. Also the bytes it keeps for backward:
    the shard and the weight, not the gathered input."""
    group = ps.tp
    col = ColumnParallelLinear(H, 24, ps=ps, bias=bias, sequence_parallel=True,
                               parts=[8, 8, 8])
    sharding.initialize_params(col, 3, ps)
    x0 = _rand(8 + group.rank, S // group.size, B, H)
    up = _rand(9 + group.rank, S, B, 24 // group.size)
    x = x0.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = col(x)
    y.backward(up)
    xr = x0.clone().requires_grad_(True)
    wr = col.weight.detach().clone().requires_grad_(True)
    br = col.bias.detach().clone().requires_grad_(True) if bias else None
    yr = F.linear(mappings.gather_from_sequence_parallel_region(xr, group), wr, br)
    yr.backward(up)
    pairs = [(y, yr), (x.grad, xr.grad), (col.weight.grad, wr.grad)]
    if bias:
        pairs.append((col.bias.grad, br.grad))
    if group.size > 1:
        assert sorted(saved) == sorted([x0.numel(), col.weight.numel()]), saved
    return 0.0 if all(torch.equal(a, b) for a, b in pairs) else 1.0


def _layers_body(rank, world_size):
    with parallel_state(tensor_model_parallel_size=world_size) as ps:
        return {"ce": _check_cross_entropy(ps.tp), "emb": _check_embedding(ps, False),
                "emb_sp": _check_embedding(ps, True), "linear": _check_linear_pair(ps),
                "sp_column": _check_sequence_parallel_column(ps, False),
                "sp_column_bias": _check_sequence_parallel_column(ps, True)}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_match_single_rank(world):
    if world == 1:
        ps = single_process_state()
        results = [{"ce": _check_cross_entropy(ps.tp), "emb": _check_embedding(ps, False),
                        "linear": _check_linear_pair(ps)}]
    else:
        results = run_distributed(world, _layers_body)
    for rank, errors in enumerate(results):
        assert all(e < 1e-5 for e in errors.values()), (rank, errors)


def test_fused_shard_takes_each_part():
    """QKV-style parts: rank r holds chunk r of every part, not a block of the fused rows."""
    p = torch.nn.Parameter(torch.empty(3, 2))
    sharding.mark_param(p, partition_dim=0, parts=(2, 2, 2), init_std=1.0)
    full = torch.arange(12.0).view(6, 2)  # rows: q0 q1 k0 k1 v0 v1
    pieces = [sharding.shard(full, p, 2, r) for r in range(2)]
    assert pieces[0][:, 0].tolist() == [0.0, 4.0, 8.0]  # q0, k0, v0
    assert torch.equal(sharding.unshard(pieces, p), full)


def test_padded_vocab_rows_are_zero_and_dropped():
    p = torch.nn.Parameter(torch.empty(4, 3))
    sharding.mark_param(p, partition_dim=0, unpadded_size=6, init_std=1.0)
    full = torch.ones(6, 3)
    pieces = [sharding.shard(full, p, 2, r) for r in range(2)]
    assert pieces[1][2:].abs().sum() == 0 and pieces[1][:2].sum() == 6
    assert torch.equal(sharding.unshard(pieces, p), full)
    assert sharding.full_shape(p, 2) == (6, 3)


def test_stable_seed_is_process_independent():
    assert sharding.stable_seed(1234, "a.weight") == sharding.stable_seed(1234, "a.weight")
    assert sharding.stable_seed(1234, "a.weight") != sharding.stable_seed(1235, "a.weight")
    # pinned: must never change, or checkpoints initialized earlier stop being reproducible
    assert sharding.stable_seed(0, "x") == int.from_bytes(
        __import__("hashlib").sha256(b"0/x").digest()[:8], "little") & (2 ** 63 - 1)


def test_gather_from_tp_region_roundtrip_single():
    ps = single_process_state()
    x = torch.ones(2, 3)
    assert mappings.gather_from_tensor_model_parallel_region(x, ps.tp) is x


def _rotate_half_reference(x, cos, sin):
    """RoPE as it was written before the fused form: ``x cos + rotate_half(x) sin``."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, x_pass], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rotary_without_copies_equals_rotate_half_formula(dtype, percent):
    from megalite.transformer.rope import RotaryEmbedding, apply_rotary

    cos, sin = RotaryEmbedding(16, percent)(torch.randint(0, 500, (7, 3)))  # any positions
    qkv = _rand(0, 7, 3, 6, 16).to(dtype)
    x = [qkv[:, :, :5].clone().requires_grad_(True) for _ in range(2)]
    up = _rand(1, 7, 3, 5, 16).to(dtype)
    want, got = _rotate_half_reference(x[0], cos, sin), apply_rotary(x[1], cos, sin)
    want.backward(up)
    got.backward(up)
    assert got.dtype == dtype and torch.equal(got, want)  # the same products and sums
    assert torch.equal(x[1].grad, x[0].grad)
    assert not torch.equal(got, x[1])  # it does rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_equals_silu_gate_times_up(dtype):
    from megalite.layers.activations import swiglu

    y = [_rand(2, 5, 3, 2 * 12).to(dtype).requires_grad_(True) for _ in range(2)]
    gate, up = y[0].chunk(2, dim=-1)
    want, got = F.silu(gate) * up, swiglu(y[1])
    grad = _rand(3, 5, 3, 12).to(dtype)
    want.backward(grad)
    got.backward(grad)
    assert torch.equal(got, want) and torch.equal(y[1].grad, y[0].grad)
    with torch.no_grad():
        assert torch.equal(swiglu(y[1]), want)
