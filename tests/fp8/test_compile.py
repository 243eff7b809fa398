"""fp8 linears inside a compiled transformer layer (``--compile``, regional compilation).

With tensorwise scaling the fp8 GEMMs' autograd function touches no state: the step's
weight copies are read and made before it (``fp8_linear``), so dynamo traces each layer,
its quantisations included, into one graph with no break, and inductor can fuse every
quantisation (amax, scale, cast, transpose) with its neighbours. A break there runs the
function eagerly, one kernel per elementwise step, which on a GPU costs more than the fp8
GEMM saves. Delayed scaling's amax records are writes to the scaling's buffers, which
the compiled graphs keep. Block recipes (blockwise, mxfp8) likewise: their weight copies
are made before the function, and the block-scaled kernel is one operator in the graph.

At tp 2 with sequence parallelism the layers' tp collectives (the all-gathers and
reduce-scatters around the linears, the amax all-reduces) are torch's functional
collectives under tracing (:mod:`megalite.parallel.collectives`), so a layer is one graph
there too, fp8 or not.

``aot_eager`` traces forward and backward as inductor would, without compiling C++, so
these tests take seconds; the losses match eager within fp32 rounding.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from megalite.config import MegaliteConfig, OptimConfig, TrainConfig
from megalite.layers.fp8 import finish_step
from megalite.models.compile import compile_model
from megalite.models.gpt import GPTModel
from megalite.optim.build import build_grads_and_optimizer
from tests.distributed.harness import parallel_state, run_distributed
from tests.model.common import batch, llama_config, single_process_state

MICRO, STEPS = 2, 2


def _train(recipe: str | None, compiled: bool, ps=None, fmt: str = "hybrid",
           **shape) -> tuple[list[float], torch.Tensor]:
    """Losses of STEPS optimizer steps of MICRO micro-batches of a 2-layer Llama (fp8 with
    ``recipe`` in format ``fmt``, fp32 with None; ``shape`` overrides its sizes) on ``ps``
    (default: one process), and its linears' amax histories stacked (delayed scaling;
    empty otherwise)."""
    model_cfg = llama_config(**{"hidden_size": 64, "ffn_hidden_size": 128, **shape})
    if recipe is not None:
        model_cfg = dataclasses.replace(model_cfg, fp8_format=fmt, fp8_recipe=recipe)
    run = MegaliteConfig(model=model_cfg, optim=OptimConfig(lr=1e-2),
                         train=TrainConfig(micro_batch_size=2, global_batch_size=2 * MICRO))
    ps = ps or single_process_state()
    torch.manual_seed(0)
    model = GPTModel(model_cfg, ps, seed=1)
    grads, optimizer = build_grads_and_optimizer(model, run, ps)
    if compiled:
        compile_model(model, backend="aot_eager")
    losses = []
    for step in range(STEPS):
        grads.zero_grad(num_microbatches=MICRO)
        total = 0.0
        for micro in range(MICRO):
            ids, labels = batch(model_cfg, seed=10 * step + micro)
            loss = model(ids, labels=labels).mean() / MICRO
            loss.backward()
            total += float(loss.detach())
        grads.finish_grad_sync()
        finish_step([model], ps)
        optimizer.step()
        losses.append(total)
    histories = [m.amax_history for m in model.modules() if hasattr(m, "amax_history")]
    return losses, torch.stack(histories) if histories else torch.empty(0)


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_tensorwise_layers_compile_into_one_graph_without_breaks(dynamo):
    """Two layers, two micro-batches a step: no graph break; one graph for the step's
    first micro-batch (which quantises the weights) and one for the later ones (which
    read the step's copies), shared by both layers."""
    eager, _ = _train("tensorwise", False)
    compiled, _ = _train("tensorwise", True)
    assert dict(dynamo["graph_break"]) == {}
    assert dynamo["stats"]["unique_graphs"] == 2
    assert compiled[-1] < compiled[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def test_delayed_scaling_compiles_and_records_the_amaxes_eager_records(dynamo):
    """Delayed scaling records each operand's amax in the forward and, for the output
    gradient, in the backward, into buffers of the scaling: the compiled layers keep those
    writes (the histories after the steps equal eager's) and break no graph."""
    eager, eager_history = _train("delayed", False)
    compiled, history = _train("delayed", True)
    assert dict(dynamo["graph_break"]) == {}
    assert eager_history.shape == (8, 3, 1) and bool((eager_history[:, 2] > 0).all())
    torch.testing.assert_close(history, eager_history, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_recipes_compile_without_breaks(dynamo, monkeypatch, recipe):
    """Block recipes (e4m3) take both of the step's weight quantisations before the GEMMs'
    autograd function, as the per-tensor ones do, so dynamo traces each layer whole. Where
    the block-scaled kernel runs (``blockwise``; a stand-in here, as in
    tests/fp8/test_gemm.py, that no tracer could follow) each GEMM is one
    ``megalite::block_scaled_mm`` node: the compiled run calls the kernel as often as eager
    does, with the same losses. ``mxfp8`` is emulated (no kernel)."""
    from megalite.layers.fp8 import gemm
    from megalite.layers.fp8.recipes import block_dequantize

    calls = []

    def kernel(a, b, sa, recipe_a, sb, recipe_b, output_dtype):
        torch._dynamo.graph_break()     # a break, were dynamo to trace into the kernel
        calls.append(a.shape)
        return (block_dequantize(a, sa) @ block_dequantize(b.t(), sb).t()).to(output_dtype)

    monkeypatch.setattr(gemm, "BLOCK_SCALED_MM", kernel)
    monkeypatch.setattr(gemm, "block_kernel_takes", lambda a, b, block, mx: block == 128)
    shape = {"hidden_size": 128, "ffn_hidden_size": 256, "seq_length": 64}
    eager, _ = _train(recipe, False, fmt="e4m3", **shape)
    eager_calls, calls[:] = len(calls), []
    compiled, _ = _train(recipe, True, fmt="e4m3", **shape)
    assert dict(dynamo["graph_break"]) == {}
    # per micro-batch 2 layers x 4 linears x 3 GEMMs
    expected = STEPS * MICRO * 2 * 4 * 3 if recipe == "blockwise" else 0
    assert eager_calls == len(calls) == expected
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def _tp2_sp(rank, world_size, recipe):
    torch.set_num_threads(1)
    with parallel_state(tensor_model_parallel_size=2, sequence_parallel=True) as ps:
        eager, eager_history = _train(recipe, False, ps)
        torch._dynamo.reset()
        counters.clear()
        compiled, history = _train(recipe, True, ps)
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
    return eager, compiled, eager_history, history, breaks, graphs


@pytest.mark.parametrize("recipe", [None, "tensorwise", "delayed"])
def test_tp2_sequence_parallel_layers_compile_without_breaks(recipe):
    """tp 2 + SP: the tp collectives inside each layer (and, in fp8, the amax
    all-reduces) are traced into the layer's graph: no break (an fp8 layer broke at
    each of them before: 19 breaks here in fp32, 41 and 21 in fp8), the graphs of one process, the
    losses and the delayed histories eager's within fp32 rounding, on both ranks."""
    for eager, compiled, eager_history, history, breaks, graphs in \
            run_distributed(2, _tp2_sp, recipe):
        assert breaks == 0
        assert graphs == (1 if recipe is None else 2)
        assert compiled[-1] < compiled[0]
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(history, eager_history, rtol=1e-6, atol=0)
