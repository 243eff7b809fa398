"""Overlap, verified by the order of events in real training (gloo, dp = 2), and the
reduction groups of dense vs expert parameters.

The trace of DataParallelGrads (``grad-final``, ``grad-sync-start``, ``param-sync-start``,
``param-sync-wait``) is interleaved with markers from forward pre-hooks on the model's
modules and from ``finish_grad_sync`` / ``optimizer.step``.
"""

import torch

from megalite.config import OptimConfig, ParallelConfig
from megalite.optim.data_parallel import DataParallelGrads
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.loss_scaler import ConstantLossScaler
from megalite.parallel.params import mark_param
from megalite.parallel.state import ParallelState
from megalite.pipeline.layout import model_chunks
from tests.distributed.harness import run_distributed
from tests.optim.common import VARIANTS, config, train_run

MICRO = 2   # micro-batches per rank: global batch 8, micro-batch 2, dp 2


def _instrument(c):
    trace = c.grads.trace = []
    root = model_chunks(c.model)[0]
    root.register_forward_pre_hook(lambda m, a: trace.append(("micro-batch",)))
    for name, module in root.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda m, a, n=name: trace.append(("forward", n)))
    finish, step = c.grads.finish_grad_sync, c.optimizer.step
    c.grads.finish_grad_sync = lambda: (trace.append(("finish-grad-sync",)), finish())[1]
    c.optimizer.step = lambda: (trace.append(("step",)), step())[1]


def _trace_body(rank, world_size):
    cfg = config(world_size, iters=2, **VARIANTS["distopt+overlap"])
    _, _, _, out = train_run(cfg, setup=_instrument, inspect=lambda c: (
        c.grads.trace, [len(b.buckets) for b in c.grads.buffers]))
    return out


def _positions(trace, kind, start=0, end=None):
    end = len(trace) if end is None else end
    return [i for i in range(start, end) if trace[i][0] == kind]


def test_overlap_order_in_training():
    for trace, buckets in run_distributed(2, _trace_body):
        assert len(buckets) == 1 and buckets[0] >= 5
        steps = _positions(trace, "step")
        assert len(steps) == 2
        begin = 0
        for end in steps:
            micro = _positions(trace, "micro-batch", begin, end)
            finish = _positions(trace, "finish-grad-sync", begin, end)[0]
            launches = _positions(trace, "grad-sync-start", begin, end)
            finals = _positions(trace, "grad-final", begin, end)
            assert len(micro) == MICRO
            # every bucket launched during the last micro-batch's backward, in order ...
            assert len(launches) == buckets[0]
            assert all(micro[-1] < i < finish for i in launches)
            assert [trace[i][3] for i in launches] == list(range(buckets[0]))
            # ... and the first one long before backward ended
            assert launches[0] < finals[-1]
            assert len([i for i in finals if i > launches[0]]) > 5
            begin = end
        # after step 1: all gathers launched at once, each waited for in the forward pre-hook
        # of the module that needs it, i.e. spread over the next forward
        starts = _positions(trace, "param-sync-start", steps[0], steps[1])
        waits = _positions(trace, "param-sync-wait", steps[0], steps[1])
        first_micro = _positions(trace, "micro-batch", steps[0], steps[1])[0]
        assert len(starts) == len(waits) == buckets[0]
        assert all(s < first_micro < w for s in starts for w in waits)
        forwards_between = _positions(trace, "forward", waits[0], waits[-1])
        assert len(forwards_between) >= 3
        assert _positions(trace, "param-sync-start", steps[1]) != []   # last step too


class TwoKinds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(4, 4)
        self.expert = torch.nn.Linear(4, 4)
        for p in self.expert.parameters():
            mark_param(p, init_std=0.1, expert=True)

    def forward(self, x):
        return (self.expert(torch.tanh(self.dense(x)))).pow(2).sum()


def _expert_body(rank, world_size, sharded):
    ps = ParallelState.build(ParallelConfig(expert_model_parallel_size=2))
    try:
        torch.manual_seed(0)
        model = TwoKinds()
        grads = DataParallelGrads(model, ps, bucket_size=10, use_distributed_optimizer=sharded,
                                  overlap_grad_reduce=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        names, params = zip(*model.named_parameters())
        local = dict(zip(names, torch.autograd.grad(model(x), params)))  # no hooks run
        grads.zero_grad(num_microbatches=1)
        model(x).backward()      # launches the reductions (in flight: do not read main_grad)
        grads.finish_grad_sync()
        reduced = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        if sharded:
            opt = DistributedOptimizer(model, OptimConfig(lr=0.1), ps, ConstantLossScaler(),
                                       grads)
            opt.step()
        groups = (ps.dp_cp.size, ps.edp.size)
        grads.remove_hooks()
        return local, reduced, groups, {n: p.detach().clone()
                                        for n, p in model.named_parameters()}
    finally:
        ps.destroy()


def test_expert_params_reduce_over_edp_only():
    for sharded in (False, True):
        out = run_distributed(2, _expert_body, sharded)
        assert out[0][2] == (2, 1)            # dense over dp_cp (2), experts over edp (1)
        for rank, (local, reduced, _, params) in enumerate(out):
            for name in reduced:
                if name.startswith("dense"):
                    want = out[0][0][name] + out[1][0][name]
                    if sharded:   # only this rank's shard of the bucket is the sum
                        continue
                    torch.testing.assert_close(reduced[name], want)
                else:
                    torch.testing.assert_close(reduced[name], local[name], rtol=0, atol=0)
            if sharded:    # dense parameters identical after the all-gather
                for name in params:
                    if name.startswith("dense"):
                        assert torch.equal(params[name], out[0][3][name])
