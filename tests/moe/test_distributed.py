"""Layout equivalence: every ep x tp (x etp, cp) x dispatcher matches one process, for
Mixtral routing, sigmoid routing with a shared expert, DeepSeek-V3 routing (groups and a
non-zero expert bias) and capacity.

On 4 gloo ranks, each data-parallel rank ``d`` feeds its own micro-batch ``X_d``
``[s, b, h]`` (its cp chunk of the sequence, and of that its ``1/tp`` chunk under sequence
parallelism) and upstream gradient ``G_d``. Checked against one process running the same
layer on every ``X_d`` in turn:

* the output and the input gradient (this rank's piece),
* the aux and z losses (values of the whole micro-batch, on every rank),
* every parameter and its gradient, after the reductions the training code performs
  (``sequence_parallel``: sum over tp; dense: sum over dp_cp; expert: sum over edp),
  gathered to full shape (etp shards, then ep slices) -- equal to the sum over ``d`` of
  the single-process gradients.

All in fp32; dropless, plus capacity with padding where ranks hold whole micro-batches.
"""

import itertools

import pytest
import torch
import torch.distributed as dist

from megalite.config import ModelConfig, ParallelConfig
from megalite.layers.sharding import gather_full
from megalite.moe.layer import MoELayer
from megalite.parallel.params import param_meta
from megalite.parallel.state import ParallelState
from tests.distributed.harness import parallel_state, run_distributed
from tests.layouts import layouts

WORLD = 4
S, B, H = 8, 2, 16
LAYOUTS = layouts("moe-layer")   # tp x sp x ep x etp x cp on 4 ranks (tests/layouts.py)
DISPATCHERS = ("alltoall", "allgather")
CONFIGS = {
    # Mixtral: SwiGLU, no biases, softmax top-2, aux + z loss
    "mixtral": {"swiglu": True, "add_bias_linear": False, "moe_aux_loss_coeff": 0.1,
                "moe_z_loss_coeff": 0.01},
    # everything else: GeLU, biases, shared expert, sigmoid + scaling, per-sequence aux
    "other": {"swiglu": False, "add_bias_linear": True,
              "moe_shared_expert_intermediate_size": 8,
              "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.0,
              "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.2},
    # DeepSeek-V3: sigmoid, group-limited (top-2 of 4 groups), a non-zero expert bias for
    # the choice, scaling, shared expert, the router in fp64
    "deepseek": {"swiglu": True, "add_bias_linear": False, "moe_router_score_function": "sigmoid",
                 "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                 "moe_router_topk_scaling_factor": 2.5, "moe_router_enable_expert_bias": True,
                 "moe_shared_expert_intermediate_size": 8, "moe_router_dtype": "fp64",
                 "moe_aux_loss_coeff": 0.1},
    # capacity 1.0 with padding: drops are decided per rank on its own tokens, so this
    # matches one process only where a rank holds whole micro-batches (tp = cp = 1)
    "capacity": {"swiglu": True, "add_bias_linear": False, "moe_aux_loss_coeff": 0.1,
                 "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
}


def _configs(layout):
    return [n for n in CONFIGS if n != "capacity" or layout.get("tp") * layout.get("cp") == 1]


TOL = {"rtol": 1e-5, "atol": 2e-6}


def _cfg(name, dispatcher, num_experts):
    return ModelConfig(hidden_size=H, num_layers=4, num_experts=num_experts, moe_router_topk=2,
                       moe_ffn_hidden_size=8, init_method_std=0.2,
                       moe_token_dispatcher_type=dispatcher, **CONFIGS[name])


def _layer(name, dispatcher, num_experts, ps, sp=False):
    layer = MoELayer(_cfg(name, dispatcher, num_experts), ps, layer_number=3, seed=11,
                     sequence_parallel=sp)
    if layer.router.expert_bias is not None:
        with torch.no_grad():
            layer.router.expert_bias.copy_(
                torch.randn(num_experts, generator=torch.Generator().manual_seed(7)) * 0.05)
    return layer


def _data(d):
    gen = torch.Generator().manual_seed(100 + d)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def _local(t, layout, tp_rank, cp_rank):
    """This rank's piece of a micro-batch tensor ``[s, b, h]``: its cp chunk of the
    sequence, then its tp chunk of that under sequence parallelism."""
    t = t.chunk(layout.get("cp"))[cp_rank]
    return t.chunk(layout.get("tp"))[tp_rank] if layout.get("sp") else t


def _all_reduce(t, group):
    if group.size > 1:
        dist.all_reduce(t, group=group.group)
    return t


def _full_tensor(t, param, ps):
    """A parameter (or its grad) in full shape: unshard over etp / tp, stack over ep."""
    if not param_meta(param).expert:
        return gather_full(t, param, ps.tp)
    t = gather_full(t, param, ps.etp)
    if ps.ep.size == 1:
        return t
    pieces = [torch.empty_like(t) for _ in range(ps.ep.size)]
    dist.all_gather(pieces, t.contiguous(), group=ps.ep.group)
    return torch.cat(pieces)


def _reduced_grad(param, ps):
    # fc2's bias under etp > 1 is used on etp rank 0 only: no gradient elsewhere
    g = torch.zeros_like(param) if param.grad is None else param.grad.clone()
    if param_meta(param).sequence_parallel:
        _all_reduce(g, ps.tp)
    return _all_reduce(g, ps.edp if param_meta(param).expert else ps.dp_cp)


def _body(rank, world_size, layouts):
    """Per layout: a record per (config, dispatcher) on this rank."""
    results = []
    for layout in layouts:
        results.append([])
        with parallel_state(**layout.parallel) as ps:
            for name, dispatcher in itertools.product(_configs(layout), DISPATCHERS):
                layer = _layer(name, dispatcher, layout.model["num_experts"], ps,
                               layout.get("sp"))
                x, g = (_local(t, layout, ps.tp.rank, ps.cp.rank) for t in _data(ps.dp.rank))
                x.requires_grad_(True)
                out = layer(x)
                (out * g).sum().backward()
                params = {n: _full_tensor(p.detach(), p, ps)
                          for n, p in layer.named_parameters()}
                grads = {n: _full_tensor(_reduced_grad(p, ps), p, ps)
                         for n, p in layer.named_parameters()}
                results[-1].append({
                    "layout": layout.name, "config": name, "dispatcher": dispatcher,
                    "dp": ps.dp.rank, "tp_rank": ps.tp.rank, "cp_rank": ps.cp.rank,
                    "out": out.detach(), "x_grad": x.grad,
                    "aux": {k: float(v) for k, v in layer.aux_losses.items()},
                    "params": params, "grads": grads,
                    "sent": dict(layer.dispatcher.counter.sent)})
    return results


def _reference(name, num_experts):
    """Per micro-batch d: output, input grad, aux values, param grads; and the params."""
    layer = _layer(name, "alltoall", num_experts, ParallelState.build(ParallelConfig()))
    refs = []
    for d in range(WORLD):
        x, g = _data(d)
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        (out * g).sum().backward()
        refs.append({"out": out.detach(), "x_grad": x.grad,
                         "aux": {k: float(v) for k, v in layer.aux_losses.items()},
                         "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
    return layer, refs


@pytest.fixture(scope="module")
def distributed_results():
    """{layout name: [this layout's records on rank 0, 1, ...]}; one world-4 call."""
    per_rank = run_distributed(WORLD, _body, LAYOUTS)
    return {lay.name: [out[n] for out in per_rank] for n, lay in enumerate(LAYOUTS)}


@pytest.fixture(scope="module")
def references():
    """Per (config, number of experts): the single-process layer and per-micro-batch
    results, built on first use."""
    cache = {}

    def get(name, num_experts):
        if (name, num_experts) not in cache:
            cache[name, num_experts] = _reference(name, num_experts)
        return cache[name, num_experts]
    return get


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_layout_matches_single_process(distributed_results, references, layout):
    checked = set()
    for rank_results in distributed_results[layout.name]:
        for r in rank_results:
            where = (r["layout"], r["config"], r["dispatcher"], r["dp"], r["tp_rank"])
            layer, per_mb = references(r["config"], layout.model["num_experts"])
            ref = per_mb[r["dp"]]
            want_out, want_xg = (_local(t, layout, r["tp_rank"], r["cp_rank"])
                                 for t in (ref["out"], ref["x_grad"]))
            torch.testing.assert_close(r["out"], want_out, **TOL, msg=lambda m, w=where: f"{w} {m}")
            torch.testing.assert_close(r["x_grad"], want_xg, **TOL,
                                       msg=lambda m, w=where: f"{w} {m}")
            assert set(r["aux"]) == set(ref["aux"]) and ref["aux"], where
            for k, v in ref["aux"].items():
                assert r["aux"][k] == pytest.approx(v, rel=1e-5), (where, k)
            for n, p in layer.named_parameters():
                assert torch.equal(r["params"][n], p.detach()), (where, n)
                want = sum(per_mb[d]["grads"][n] for d in range(layout.dp))
                torch.testing.assert_close(r["grads"][n], want, **TOL,
                                           msg=lambda m, w=where, n=n: f"{w} {n} {m}")
            checked.add((r["config"], r["dispatcher"]))
    assert len(checked) == len(_configs(layout)) * len(DISPATCHERS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dispatchers_count_their_bytes(distributed_results, layout):
    """alltoall sends only the routed copies that leave their rank (and brings them back);
    allgather sends every token to every peer and reduce-scatters the same amount."""
    totals = {}
    for rank_results in distributed_results[layout.name]:
        for r in rank_results:
            key = (r["config"], r["dispatcher"])
            for name, n in r["sent"].items():
                totals.setdefault(key, {}).setdefault(name, 0)
                totals[key][name] += n
    tp, ep, etp, cp = (layout.get(s) for s in ("tp", "ep", "etp", "cp"))
    for (config, dispatcher), sent in totals.items():
        what = (layout.name, config, dispatcher)
        tokens = S * B // (tp * cp)  # per rank (split over tp even without SP)
        copies = WORLD * tokens * 2 * H * 4  # T * k * h * fp32 over all ranks
        if ep == 1:
            assert "dispatch" not in sent, what
        elif dispatcher == "alltoall":
            assert 0 < sent["dispatch"] == sent["combine"] < copies, what
            assert sent["counts"] == WORLD * (ep - 1) * (8 // ep) * 8  # int64 counts
        else:
            assert sent["dispatch"] == sent["combine"] == WORLD * tokens * H * 4 * (ep - 1)
        if etp > 1:
            assert sent["etp_gather"] == sent["etp_reduce_scatter"] > 0, what
        else:
            assert "etp_gather" not in sent, what


def _comm_body(rank, world_size):
    """Uneven all-to-all / gather / reduce-scatter with empty blocks, forward and backward,
    against the same exchange written out by hand."""
    from megalite.moe import comm

    with parallel_state() as ps:
        world = ps.dp  # all 4 ranks
        # send[r][q] rows from rank r to rank q; rank 3 sends nothing, rank 2 gets nothing
        send = [[1, 2, 0, 1], [0, 1, 0, 3], [2, 0, 0, 1], [0, 0, 0, 0]]
        rows = {r: torch.arange(sum(send[r]) * 2, dtype=torch.float64).view(-1, 2) + 100 * r
                for r in range(4)}
        x = rows[rank].clone().requires_grad_(True)
        recv = [send[q][rank] for q in range(4)]
        y = comm.all_to_all(x, send[rank], recv, world)
        want = []
        for q in range(4):  # rows of rank q destined to this rank
            start = sum(send[q][:rank])
            want.append(rows[q][start:start + send[q][rank]])
        ok = torch.equal(y, torch.cat(want))
        y.backward(torch.full_like(y, float(rank + 1)))  # grad of a row: its receiver + 1
        dest = torch.repeat_interleave(torch.arange(4.0), torch.tensor(send[rank]))
        ok &= torch.equal(x.grad, (dest + 1).unsqueeze(1).expand(-1, 2).double())

        sizes = [2, 0, 3, 1]
        z = torch.full((sizes[rank], 2), float(rank), dtype=torch.float64, requires_grad=True)
        gathered = comm.gather_uneven(z, sizes, world)
        ok &= torch.equal(gathered[:, 0], torch.repeat_interleave(
            torch.arange(4.0, dtype=torch.float64), torch.tensor(sizes)))
        gathered.backward(torch.ones_like(gathered))
        ok &= torch.equal(z.grad, torch.full_like(z, 4.0))  # every rank's copy counts
        part = torch.ones(sum(sizes), 2, dtype=torch.float64, requires_grad=True)
        reduced = comm.scatter_reduce_uneven(part, sizes, world)
        ok &= torch.equal(reduced, torch.full((sizes[rank], 2), 4.0, dtype=torch.float64))
        return bool(ok)


def test_uneven_collectives_with_empty_blocks():
    assert run_distributed(WORLD, _comm_body) == [True] * WORLD
