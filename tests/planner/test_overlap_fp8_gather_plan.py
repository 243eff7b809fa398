"""The planner's model of three communication savings: ``--overlap-moe-expert-parallel-comm``
hides the paired backwards' share of the expert all-to-all behind the same share of the
rank's compute, ``--moe-shared-expert-overlap`` the forward's dispatch behind the shared
experts' forward, and ``--fp8-param-gather`` gathers the fp8 linears' weights as one byte
per element in the distributed optimizer's parameter all-gather (ZeRO-3's later gathers
of the step leave them out)."""

from __future__ import annotations

import dataclasses

import pytest

from megalite.arguments import parse_args
from megalite.config.layout import resolve_layout
from megalite.planner.cluster import preset
from megalite.planner.fp8_memory import fp8_linear_weights
from megalite.planner.memory import stage_param_counts
from megalite.planner.schedule import paired_backward_share
from megalite.planner.time import estimate_time
from tests.planner.test_fp8_plan import FP8
from tests.planner.test_fp8_plan import LLAMA as FP8_LLAMA

MOE = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
       "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings",
       "2048", "--vocab-size", "32000", "--micro-batch-size", "1", "--bf16",
       "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1408",
       "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "8",
       "--tokenizer-type", "NullTokenizer", "--mock-data"]


@pytest.mark.parametrize("pp, m, want", [
    (1, 8, 7 / 8),    # every backward but the last is followed by a forward
    (2, 8, 6 / 8),    # the first stage: m - pp pairs after its pp - 1 warm-up forwards
    (4, 8, 4 / 8),
    (4, 4, 0.0),      # all forwards in the warm-up: nothing to pair
])
def test_paired_share_is_the_first_stages_steady_state(pp, m, want):
    assert paired_backward_share(pp, m) == pytest.approx(want)
    assert paired_backward_share(pp, m, schedule="zb_h1") == 0.0   # refused with it


def test_paired_share_interleaved():
    # pp 2, vpp 2, m 8: 16 backwards per rank; stage 0 pairs 2m - 5 = 11 of them (its
    # warm-up holds 2(p - 1) + (v - 1) p = 4 forwards), stage 1 pairs 2m - 3 = 13
    assert paired_backward_share(2, 8, 2, "interleaved_1f1b") == pytest.approx(11 / 16)


def _time(world, *extra):
    cfg = parse_args(MOE + list(extra))
    cfg.validate(world)
    return cfg, estimate_time(cfg, world, preset("h100", 1))


def test_overlap_hides_the_paired_share_of_the_all_to_all():
    gb = ["--global-batch-size", "64"]      # 8 micro-batches on each of the 8 dp ranks
    _, plain = _time(8, *gb)
    _, over = _time(8, *gb, "--overlap-moe-expert-parallel-comm")
    # on NVLink the all-to-all is shorter than the compute: the paired 7/8 is hidden
    assert plain.comm["ep"] > 0
    assert plain.compute > plain.comm["ep"]
    assert over.comm["ep"] == pytest.approx(plain.comm["ep"] / 8)
    assert over.compute == pytest.approx(plain.compute)
    # a network 1000x slower: the all-to-all outlasts the compute, and only the compute's
    # worth of the paired share is hidden
    cfg, _ = _time(8, *gb)
    slow = dataclasses.replace(preset("h100", 1), intra_node_bw=preset("h100", 1)
                               .intra_node_bw / 1000)
    a2a = estimate_time(cfg, 8, slow)
    cfg_o, _ = _time(8, *gb, "--overlap-moe-expert-parallel-comm")
    a2a_o = estimate_time(cfg_o, 8, slow)
    assert a2a.comm["ep"] > a2a.compute
    assert a2a_o.comm["ep"] == pytest.approx(a2a.comm["ep"] - 7 / 8 * a2a.compute)


_TP = FP8_LLAMA.index("--tensor-model-parallel-size")
LLAMA = [f for f in FP8_LLAMA[:_TP] + FP8_LLAMA[_TP + 2:] if f != "--sequence-parallel"] \
    + FP8 + ["--use-distributed-optimizer"]   # tp 1: dp 8


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_fp8_param_gather_sends_one_byte_per_fp8_weight(strategy):
    flags = LLAMA + ["--data-parallel-sharding-strategy", strategy]
    cfg, plain = _time(8, *flags)
    _, fp8 = _time(8, *flags, "--fp8-param-gather")
    lay = resolve_layout(cfg, 8)
    params = sum(stage_param_counts(cfg.model, cfg.parallel, 0))
    fp8_weights = sum(fp8_linear_weights(cfg.model, layer) for layer in range(8))
    gathers = 1 if strategy == "optim" else 2 * lay.num_microbatches
    # the gathers' bytes per rank: (d - 1) / d of (P - P8) bf16 bytes and P8 fp8 bytes
    # each (ZeRO-3's freed units keep no fp8 weights: every gather sends them)
    saved = 7 / 8 * gathers * fp8_weights
    assert plain.comm_bytes["dp"] - fp8.comm_bytes["dp"] == pytest.approx(saved)
    rounds = 1 if strategy == "optim" else lay.num_microbatches   # ZeRO-3: per micro-batch
    assert plain.comm_bytes["dp"] == pytest.approx(    # fp32 gradients, bf16 parameters
        7 / 8 * (rounds * 4 * params + gathers * 2 * params))
    assert fp8.comm["dp"] < plain.comm["dp"]
    # the weights' quantisation (megalite.planner.fp8_time), tensorwise in bf16: 5 bytes an
    # element (amax 2, cast 2 + 1) on every rank once per step, under ZeRO-3 after each of
    # the step's gathers; with the flag each owner casts its eighth once, and the gathers
    # bring the fp8 bytes (the transposed copies alike in both)
    casts = fp8_weights * 5 * (gathers - 1 / 8)
    assert plain.compute - fp8.compute == pytest.approx(casts / preset("h100").memory_rate)


@pytest.mark.parametrize("shared", [8192, 64])
def test_shared_expert_overlap_hides_the_forward_dispatch(shared):
    """--moe-shared-expert-overlap: the forward's dispatch (a quarter of the all-to-all)
    runs under the shared experts' forward matmuls, hidden up to their length."""
    gb = ["--global-batch-size", "64", "--moe-shared-expert-intermediate-size", str(shared)]
    cfg, plain = _time(8, *gb)
    _, over = _time(8, *gb, "--moe-shared-expert-overlap")
    cluster = preset("h100", 1)
    h = cfg.model.hidden_size
    params = 2 * h * shared + shared + h           # fc1 and fc2 with their biases
    tokens = 64 * cfg.model.seq_length
    forward = 2.0 * params * 4 * tokens / 8 / cluster.peak_flops / cluster.matmul_efficiency
    a2a = plain.comm["ep"]
    assert a2a > 0
    assert over.comm["ep"] == pytest.approx(a2a - min(a2a / 4, forward))
    if shared == 8192:     # a wide shared expert outlasts the dispatch: all of it hidden
        assert forward > a2a / 4 and over.comm["ep"] == pytest.approx(0.75 * a2a)
    else:                  # a narrow one hides only its own length
        assert 0 < forward < a2a / 4
