"""The planner searches the data-parallel overlap flags with the layout instead of taking
them from the model's flags: Llama-2 7B on 64 H100s is plain data parallelism with the
reduction and the parameter gather overlapped, not an 8-stage pipeline."""

from __future__ import annotations

from megalite.arguments import parse_args
from megalite.planner.cluster import preset
from megalite.planner.search import search

LLAMA2_7B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
             "--num-attention-heads", "32", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--normalization", "RMSNorm", "--swiglu",
             "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--global-batch-size", "1024", "--bf16",
             "--vocab-size", "32000", "--tokenizer-type", "NullTokenizer", "--mock-data"]
NARROW = dict(tp=[1], pp=[1, 8], vpp=[1], strategies=("optim",), recomputes=("none",),
              micro_batch_sizes=(1,), offloads=(0.0,))


def test_llama2_7b_on_64_h100s_is_data_parallel_with_overlap():
    cands = search(parse_args(LLAMA2_7B), preset("h100", 8), **NARROW)
    best = cands[0]
    assert best.feasible and best.sizes["pp"] == 1 and best.sizes["dp"] == 64
    assert best.overlap and best.cfg.parallel.overlap_grad_reduce
    assert best.cfg.parallel.overlap_param_gather
    flags = best.launch_flags()
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" in flags
    assert best.name().endswith("overlap")
    # the same layout without overlap exposes the reduction and the gather: slower
    plain = next(c for c in cands if c.sizes == best.sizes and not c.overlap)
    assert plain.time.comm["dp"] > 4 * best.time.comm["dp"] > 0
    assert plain.time.step > best.time.step


def test_without_overlap_the_pipeline_wins_which_is_why_it_is_searched():
    cands = search(parse_args(LLAMA2_7B + ["--overlap-grad-reduce"]), preset("h100", 8),
                   overlaps=(False,), **NARROW)
    assert cands[0].sizes["pp"] == 8 and not cands[0].overlap
    assert not cands[0].cfg.parallel.overlap_grad_reduce   # the model's flag set aside


def test_no_overlap_candidate_where_nothing_is_data_parallel():
    small = LLAMA2_7B[:]
    small[small.index("--global-batch-size") + 1] = "8"
    cands = search(parse_args(small), preset("h100", 1), tp=[8], pp=[1], vpp=[1],
                   strategies=("no_shard",), recomputes=("none",), micro_batch_sizes=(1,),
                   offloads=(0.0,))
    assert [c.overlap for c in cands] == [False]
