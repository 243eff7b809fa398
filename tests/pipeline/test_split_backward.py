"""A backward split into B (input gradients) and W (deferred weight gradients) gives the
fused backward's gradients bit for bit (``megalite.parallel.weight_grad``).

Each case runs a tiny model's forward and backward three ways on the same weights and
batch: the usual fused backward (``F.linear`` everywhere), the fused backward of the
deferrable graph (forward inside ``splittable``), and the split one (B inside
``deferring``, then W); gradients are compared with ``torch.equal``, both as
``param.grad`` and through a gradient buffer (``main_grad`` via the post-accumulate-grad
hooks). Over two micro-batches whose W steps run after both B steps, in micro-batch
order, the accumulated gradients are still identical.
"""

import pytest
import torch

from megalite.models.gpt import GPTModel
from megalite.optim.data_parallel import DataParallelGrads
from megalite.parallel import weight_grad
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import batch, gpt2_config, llama_config, mixtral_config


def _grads(model, ids_labels, mode, buffers=False):
    """Gradients of every parameter after the micro-batches ``ids_labels`` (name -> tensor).

    mode: ``fused`` (plain model), ``fused-split-graph`` (deferrable functions, nothing
    deferred), ``split`` (every B, then every W in micro-batch order)."""
    grads = None
    if buffers:
        grads = DataParallelGrads(model, model.ps)
        grads.zero_grad(num_microbatches=len(ids_labels))
    for p in model.parameters():
        p.grad = None
    queues = []
    for ids, labels in ids_labels:
        if mode == "fused":
            loss = model(ids, labels=labels).sum()
            loss.backward()
            continue
        with weight_grad.splittable():
            loss = model(ids, labels=labels).sum()
        if mode == "fused-split-graph":
            loss.backward()
            continue
        with weight_grad.deferring() as queue:
            loss.backward()
        assert queue, "no weight gradient was deferred"
        queues.append(queue)
    for queue in queues:
        weight_grad.apply(queue)
        assert not queue
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad if buffers else p.grad
        out[name] = g.clone()
    if grads is not None:
        grads.remove_hooks()
    return out


def _compare(model_fn, ids_labels, buffers):
    ref = _grads(model_fn(), ids_labels, "fused", buffers)
    for mode in ("fused-split-graph", "split"):
        got = _grads(model_fn(), ids_labels, mode, buffers)
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), (mode, name,
                                                       (got[name] - ref[name]).abs().max())


def _microbatches(cfg, n):
    return [batch(cfg, seed=k) for k in range(n)]


@pytest.mark.parametrize("buffers", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_split_backward_is_bitwise_tp1(family, buffers):
    cfg = {"gpt2": gpt2_config, "llama": llama_config, "mixtral": mixtral_config}[family]()
    with parallel_state() as ps:
        _compare(lambda: GPTModel(cfg, ps, seed=1), _microbatches(cfg, 2), buffers)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_weights_are_deferred(family):
    """B leaves every linear weight (and the experts' stacked ones) without a gradient;
    W gives it."""
    cfg = {"llama": llama_config, "mixtral": mixtral_config}[family]()
    with parallel_state() as ps:
        model = GPTModel(cfg, ps, seed=1)
        ids, labels = batch(cfg)
        with weight_grad.splittable():
            loss = model(ids, labels=labels).sum()
        with weight_grad.deferring() as queue:
            loss.backward()
        missing = {n for n, p in model.named_parameters() if p.grad is None}
        assert missing and all(n.endswith(("weight", "fc1", "fc2")) for n in missing)
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in missing
        if family == "mixtral":
            assert {"decoder.layers.0.mlp.experts.fc1", "decoder.layers.0.mlp.experts.fc2",
                    } <= missing
            assert "decoder.layers.0.mlp.router.weight" not in missing   # in B
        else:
            assert "decoder.layers.0.mlp.linear_fc1.weight" in missing
        assert len(queue) == len(missing)
        weight_grad.apply(queue)
        assert all(p.grad is not None for p in model.parameters())


def _tp2_body(rank, world_size, sp, buffers):
    cfg = gpt2_config()
    with parallel_state(tensor_model_parallel_size=2, sequence_parallel=sp) as ps:
        _compare(lambda: GPTModel(cfg, ps, sequence_parallel=sp, seed=1),
                 _microbatches(cfg, 2), buffers)
    return True


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_split_backward_is_bitwise_tp2(sp):
    assert all(run_distributed(2, _tp2_body, sp, True))


def test_w_after_the_graph_is_gone_under_full_recompute():
    """Full recomputation hands B an alias of each weight that reaches its parameter only
    through the parameter's accumulation node, which autograd holds weakly: with the
    forward's graph dropped before W (no later forward of the chunk keeps the node), the
    W step must still accumulate into the parameter (the queue holds the node)."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from megalite.layers.linear import ColumnParallelLinear
    with parallel_state() as ps:
        torch.manual_seed(0)
        lin = ColumnParallelLinear(8, 8, bias=False, gather_output=True, ps=ps, init_std=0.1)
    x = torch.randn(4, 2, 8)

    def run(split):
        lin.weight.grad = None
        with weight_grad.splittable() if split else torch.enable_grad():
            out = checkpoint(lambda t: lin(t)[0], x, use_reentrant=False)
        if not split:
            out.sum().backward()
            return lin.weight.grad.clone()
        with weight_grad.splittable(), weight_grad.deferring() as queue:
            out.sum().backward()   # the recomputed forward inside builds the same graph
        del out
        gc.collect()
        weight_grad.apply(queue)
        return lin.weight.grad

    fused = run(False)
    got = run(True)
    assert got is not None and torch.equal(got, fused)
