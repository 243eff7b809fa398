"""Gradient buffers in one process: layout, accumulation, dtypes, the last-micro-batch
API and its misuse, expert parameters, and bad input through the CLI."""

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError, OptimConfig, ParallelConfig
from megalite.optim.data_parallel import DataParallelGrads
from megalite.parallel.params import is_expert_param, mark_param, param_meta, update_meta
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.optim.grad_buffer import GradBuffer
from megalite.optim.loss_scaler import ConstantLossScaler
from megalite.parallel.state import ParallelState


def single_state() -> ParallelState:
    return ParallelState.build(ParallelConfig())


class Stack(torch.nn.Module):
    """``n`` linear layers of width 8 (72 elements each), then a tied-embedding-like head."""

    def __init__(self, n=4, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=dtype) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.float().pow(2).sum()


def test_layout_buckets_views_and_padding():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 3, 11, 2)]
    update_meta(params[2], shared_embedding=True)
    group = single_state().dp_cp
    buf = GradBuffer(params, group, torch.float32, bucket_size=9, sharded=False,
                     device=torch.device("cpu"))
    # back to front: 2 | 11 -> bucket (13 >= 9); 3 alone (shared embedding); 7 | 5 -> bucket
    assert [[p.numel() for p in b.params] for b in buf.buckets] == [[2, 11], [3], [7, 5]]
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 13), (13, 16), (16, 28)]
    for p in params:
        assert p.main_grad.data_ptr() >= buf.grad_data.data_ptr()
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
    # sharded over a group of 1: padding to a multiple of 1 changes nothing, params move
    values = [p.detach().clone() for p in params]
    sharded = GradBuffer(params, group, torch.bfloat16, 9, True, torch.device("cpu"))
    assert sharded.grad_data.dtype == torch.bfloat16 and sharded.param_data.numel() == 28
    for p, v in zip(params, values):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == sharded.param_data.untyped_storage().data_ptr()


def test_padding_to_group_size():
    spans = GradBuffer._layout([torch.zeros(5), torch.zeros(6), torch.zeros(3)], 4, 4)
    assert [(len(m), s, e) for m, s, e in spans] == [(1, 0, 8), (1, 8, 16), (1, 16, 20)]


def test_accumulation_over_microbatches_in_fp32_and_bf16():
    ps = single_state()
    for bf16 in (False, True):
        model = Stack()
        grads = DataParallelGrads(model, ps, bucket_size=100, grad_reduce_in_bf16=bf16)
        xs = [torch.randn(3, 8) for _ in range(3)]
        expected = [torch.zeros_like(p) for p in model.parameters()]
        for x in xs:
            g = torch.autograd.grad(model(x), list(model.parameters()))
            expected = [e + gi for e, gi in zip(expected, g)]
        grads.zero_grad(num_microbatches=3)
        for x in xs:
            model(x).backward()
        grads.finish_grad_sync()
        for p, want in zip(model.parameters(), expected):
            assert p.grad is None
            assert p.main_grad.dtype == (torch.bfloat16 if bf16 else torch.float32)
            torch.testing.assert_close(p.main_grad.float(), want,
                                       rtol=2e-2 if bf16 else 1e-6, atol=1e-2 if bf16 else 0)
        grads.remove_hooks()


def _launch_points(trace):
    return [i for i, e in enumerate(trace) if e[0] == "grad-sync-start"]


def test_last_microbatch_signalling():
    ps = single_state()
    model = Stack()
    grads = DataParallelGrads(model, ps, bucket_size=72, overlap_grad_reduce=True)
    grads.trace = []
    x = torch.randn(2, 8)
    # no signal at all: nothing launches before finish_grad_sync
    grads.zero_grad()
    model(x).backward()
    model(x).backward()
    assert _launch_points(grads.trace) == []
    grads.finish_grad_sync()
    assert len(_launch_points(grads.trace)) == len(grads.buffers[0].buckets) == 4
    # explicit flag, as a schedule would set it before each backward
    grads.trace.clear()
    grads.zero_grad()
    grads.set_last_microbatch(False)
    model(x).backward()
    assert _launch_points(grads.trace) == []
    grads.set_last_microbatch(True)
    model(x).backward()
    launches = _launch_points(grads.trace)
    assert [grads.trace[i][3] for i in launches] == [0, 1, 2, 3]       # in bucket order
    finals = [i for i, e in enumerate(grads.trace) if e[0] == "grad-final"]
    assert launches[0] < finals[-1]      # bucket 0 went out while backward still ran
    # a backward pass more than announced raises instead of corrupting a reduction
    grads.zero_grad(num_microbatches=1)
    model(x).backward()
    with pytest.raises(RuntimeError, match="after its bucket's data-parallel reduction"):
        model(x).backward()
    grads.remove_hooks()


def test_expert_param_marks():
    """One record, one reader: an unmarked parameter is dense; ``expert`` marks experts."""
    p = torch.nn.Parameter(torch.zeros(2))
    assert not is_expert_param(p) and not param_meta(p).tensor_parallel
    mark_param(p, init_std=1.0, expert=True, first_expert=4)
    assert is_expert_param(p) and param_meta(p).first_expert == 4
    q = torch.nn.Parameter(torch.zeros(2))
    mark_param(q, init_std=1.0, sequence_parallel=True)   # e.g. the MoE router
    assert not is_expert_param(q) and param_meta(q).sequence_parallel
    r = torch.nn.Parameter(torch.zeros(4, 2))
    mark_param(r, init_std=1.0, partition_dim=0, sequence_parallel=True)
    assert not param_meta(r).sequence_parallel   # a sharded tensor's grad is complete


def test_bad_construction():
    ps = single_state()
    with pytest.raises(ValueError, match="bucket_size must be > 0"):
        DataParallelGrads(Stack(), ps, bucket_size=0)
    with pytest.raises(ValueError, match="overlap_param_gather needs"):
        DataParallelGrads(Stack(), ps, overlap_param_gather=True)
    model = Stack()
    grads = DataParallelGrads(model, ps)
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(model, OptimConfig(), ps, ConstantLossScaler(), grads)
    grads.remove_hooks()


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "60"]


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], "needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--ddp-bucket-size", "0"], "--ddp-bucket-size must be > 0"),
    (["--ddp-bucket-size", "-5"], "--ddp-bucket-size must be > 0, got -5"),
])
def test_bad_flags_fail_clearly(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(BASE + flags).validate(2)


def test_good_flags_reach_the_config():
    cfg = parse_args(BASE + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather", "--ddp-bucket-size", "1000",
                             "--grad-reduce-in-bf16"]).validate(2)
    p = cfg.parallel
    assert (p.use_distributed_optimizer, p.overlap_grad_reduce, p.overlap_param_gather,
            p.ddp_bucket_size, p.grad_reduce_in_bf16) == (True, True, True, 1000, True)
