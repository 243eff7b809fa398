"""tools/plan_layout.py and the search: legal layouts only, flags that megalite accepts,
infeasible layouts named with the limit they break, the pipeline terms from the
schedule."""

from __future__ import annotations

import pytest

from megalite.arguments import parse_args
from megalite.planner.cluster import GIB, Cluster, preset
from megalite.planner.memory import estimate_memory
from megalite.planner.schedule import bubble_fraction, peak_in_flight
from megalite.planner.search import search
from tests.tools import load_tool

SMALL = ["--num-layers", "8", "--hidden-size", "768", "--num-attention-heads", "12",
         "--seq-length", "2048", "--vocab-size", "32000", "--global-batch-size", "64",
         "--bf16", "--tokenizer-type", "NullTokenizer", "--mock-data"]


def test_peak_in_flight_follows_the_schedules():
    assert [peak_in_flight(4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(4, 0, 2) == 2                 # fewer micro-batches than stages
    assert peak_in_flight(1, 0, 8) == 1                 # gradient accumulation
    # interleaved: more (micro-batch, chunk) pairs, each half the layers
    assert peak_in_flight(2, 0, 4, vpp=2) > peak_in_flight(2, 0, 4)


def test_zero_bubble_terms_follow_the_schedule():
    """ZB-H1: every rank holds 1F1B's rank-0 peak (until its W steps), and a third of
    1F1B's bubble once m >= p."""
    assert [peak_in_flight(4, r, 8, schedule="zb_h1") for r in range(4)] == [4] * 4
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, schedule="zb_h1") == pytest.approx(3 / 24)
    assert bubble_fraction(8, 16, schedule="zb_h1") == pytest.approx(7 / 48)


def test_search_ranks_the_pipeline_schedules():
    """With one chunk per rank the search tries 1F1B and ZB-H1: ZB-H1 at the same
    busiest-rank memory and a smaller bubble ranks first; its flags select it."""
    base = parse_args(SMALL)
    cands = search(base, preset("h100", 1), tp=[1], pp=[4], vpp=[1], micro_batch_sizes=(1,),
                   strategies=("no_shard",), recomputes=("none",), overlaps=(False,))
    assert [c.schedule for c in cands] == ["zb_h1", None]
    zb, ofob = cands
    assert zb.time.bubble == pytest.approx(ofob.time.bubble / 3)
    assert zb.time.step < ofob.time.step
    assert estimate_memory(zb.cfg, 8, 0).total == estimate_memory(ofob.cfg, 8, 0).total
    assert "--pipeline-schedule" in zb.launch_flags() and "zb_h1" in zb.name()
    assert parse_args(SMALL + zb.launch_flags()).validate(8).parallel.pipeline_schedule \
        == "zb_h1"


def test_search_proposes_only_layouts_megalite_accepts():
    base = parse_args(SMALL)
    cands = search(base, preset("h100", 1), micro_batch_sizes=(1, 2))
    feasible = [c for c in cands if c.feasible]
    assert feasible and all(c.time.step > 0 for c in feasible)
    steps = [c.time.step for c in feasible]
    assert steps == sorted(steps)
    for c in feasible[:20]:
        # the printed flags, parsed by megalite and validated for the world, give the layout
        cfg = parse_args(SMALL + c.launch_flags()).validate(8)
        p = cfg.parallel
        assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (
            c.sizes["tp"], c.sizes["pp"])
        assert p.use_distributed_optimizer == (c.strategy != "no_shard")
    refused = [c for c in cands if c.error and c.error.startswith("config:")]
    # 12 heads do not divide over tp 8: megalite's check_layout refuses, and so the planner
    assert refused and all("tp8" not in c.name() or not c.feasible for c in cands)
    assert any("num_attention_heads (12)" in c.error for c in refused)


def test_memory_limit_is_named():
    base = parse_args(SMALL)
    tiny_gpu = Cluster(8, 1, 2 * GIB, 989e12, 450e9, 50e9)
    cands = search(base, tiny_gpu, micro_batch_sizes=(1,))
    over = [c for c in cands if c.error and c.error.startswith("memory:")]
    assert over and all("GiB per rank >" in c.error for c in over)
    assert all(c.memory.total <= 0.9 * 2 * GIB for c in cands if c.feasible)


def test_cli_prints_ranked_layouts_and_flags(capsys):
    tool = load_tool("plan_layout")
    code = tool.main(["--preset", "a100", "--nodes", "1", "--top", "3",
                      "--micro-batch-sizes", "1", "--"] + SMALL[:-4])
    out = capsys.readouterr().out
    assert code == 0
    assert "launch flags: --tensor-model-parallel-size" in out
    assert "MFU" in out and "best layout:" in out


def test_script_flags_keep_known_flags_and_drop_layout(tmp_path):
    tool = load_tool("plan_layout")
    script = tmp_path / "train.sh"
    script.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py \\\n"
                      "  --num-layers 8 --hidden-size 1024 --num-attention-heads 16 \\\n"
                      "  --tensor-model-parallel-size 2 --sequence-parallel --no-such-flag 3\n")
    flags, skipped = tool.script_flags(script.read_text())
    assert "--no-such-flag" in skipped and "--nproc-per-node" in skipped
    assert tool.strip_layout(flags) == ["--num-layers", "8", "--hidden-size", "1024",
                                        "--num-attention-heads", "16"]


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_presets(name):
    c = preset(name, 2)
    assert c.world_size == 16 and c.gpu_memory > 40 * GIB and c.peak_flops > 1e14


def test_script_flags_read_megatron_style_scripts(tmp_path):
    """Bash arrays, "--flag value" strings, $VARIABLES and ${X:-default} as Megatron-LM's
    example scripts write them; the command line after the arrays is not a value."""
    tool = load_tool("plan_layout")
    text = ('NUM_LAYERS=4\nSEQ=${SEQ:-"256"}\nOUT=${1:-"runs/x"}\n'
            'MODEL_ARGS=(\n    --num-layers $NUM_LAYERS\n    --seq-length ${SEQ}\n'
            '    "--hidden-size 64"\n    --swiglu\n)\n'
            'IO_ARGS=(\n    --save $OUT/ckpt\n    --lr -1e-3\n)\n'
            'python -m torch.distributed.run --nproc_per_node 2 pretrain_gpt.py \\\n'
            '    ${MODEL_ARGS[@]} "${IO_ARGS[@]}" --data-path 0.5 a 0.5 b\n')
    flags, skipped = tool.script_flags(text)
    assert flags == ["--num-layers", "4", "--seq-length", "256", "--hidden-size", "64",
                     "--swiglu", "--save", "runs/x/ckpt", "--lr", "-1e-3",
                     "--data-path", "0.5", "a", "0.5", "b"]
    assert skipped == ["--nproc_per_node"]


@pytest.mark.parametrize("script", ["gpt3_175b", "llama3_8b", "mixtral_8x7b"])
def test_plan_layout_reads_the_bundled_megatron_scripts(script, capsys):
    """The adapted Megatron-LM launch scripts plan as they are (paths, data and tokenizer
    flags set aside; the model and batch kept)."""
    tool = load_tool("plan_layout")
    code = tool.main(["--preset", "h100", "--nodes", "1", "--gpus-per-node", "2", "--top", "1",
                      "--megatron-script", f"scripts/megatron_examples/{script}.sh"])
    out = capsys.readouterr().out
    assert code == 0 and "best layout: " in out, out
    assert "launch flags: --tensor-model-parallel-size" in out


MODEL = SMALL[:-4]   # the model and batch, without the tokenizer and data flags


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "0"], "--nodes must be an integer >= 1, got 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1, got 0"),
    (["--gpu-memory-gib", "-5"], "--gpu-memory-gib must be a positive number, got -5.0"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib must be a positive number, got 0.0"),
    (["--matmul-efficiency", "nan"], "--matmul-efficiency must be in (0, 1], got nan"),
    (["--matmul-efficiency", "1.5"], "--matmul-efficiency must be in (0, 1], got 1.5"),
    (["--memory-efficiency", "0"], "--memory-efficiency must be in (0, 1], got 0.0"),
    (["--memory-efficiency", "2"], "--memory-efficiency must be in (0, 1], got 2.0"),
    (["--peak-tflops", "-100"], "--peak-tflops must be a positive number, got -100.0"),
    (["--peak-fp32-tflops", "0"], "--peak-fp32-tflops must be a positive number, got 0.0"),
    (["--inter-node-gbps", "nan"], "--inter-node-gbps must be a positive number, got nan"),
    (["--megatron-script", "/nonexistent.sh"],
     "--megatron-script /nonexistent.sh: cannot read it (No such file or directory)"),
    (["--tp", "3"], "no layout to evaluate: --tp 3 on 8 GPUs: world size (8) must be "
                    "divisible by tensor_model_parallel_size (3) x pipeline_model_parallel_size "
                    "(1) x context_parallel_size (1) = 3"),
    (["--vpp", "3"], "no layout to evaluate: --vpp 3 on 8 GPUs: num_layers (8) must be "
                     "divisible by pipeline_model_parallel_size (2) x virtual pipeline size (3)"),
])
def test_bad_cluster_and_search_flags_exit_2_with_one_line(flags, message, capsys):
    """Numbers that cannot describe a cluster (a NaN or negative step time would be
    ranked), an unreadable script, and forced sizes megalite refuses: one line naming the
    flag, the value and the rule, exit 2, no ranking."""
    code = load_tool("plan_layout").main([*flags, "--micro-batch-sizes", "1", "--", *MODEL])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, out
    assert len(lines) == 1 and lines[0].startswith("plan_layout.py: error: "), out.err
    assert message in lines[0] and "best layout" not in out.out


def test_a_forced_size_left_out_is_named_beside_the_others(capsys):
    code = load_tool("plan_layout").main(["--tp", "3", "4", "--micro-batch-sizes", "1", "--",
                                          *MODEL])
    out = capsys.readouterr().out
    assert code == 0 and "best layout: tp4" in out
    assert "note: left out --tp 3 on 8 GPUs: world size (8) must be divisible" in out


def test_no_feasible_layout_names_the_first_refusal(capsys):
    """12 heads over tp 8: every layout with the forced size is refused, and the summary
    says why even with the list of refusals turned off."""
    code = load_tool("plan_layout").main(["--tp", "8", "--show-infeasible", "0",
                                          "--micro-batch-sizes", "1", "--", *MODEL])
    out = capsys.readouterr().out
    assert code == 1
    assert ("no feasible layout; the first refused, tp8 pp1 dp1 no_shard rc-none mbs1: "
            "config: num_attention_heads (12) must be divisible by "
            "tensor_model_parallel_size (8)") in out


def test_a_config_file_with_data_paths_plans_on_mock_data(tmp_path, capsys):
    """The planner sets the data aside: a run's YAML with its data path plans as it is."""
    f = tmp_path / "run.yaml"
    f.write_text("data_path: [0.5, a, 0.5, b]\nsplit: 99,1,0\n")
    code = load_tool("plan_layout").main(["--micro-batch-sizes", "1", "--top", "1", "--",
                                          *MODEL, "--config", str(f)])
    assert code == 0 and "best layout:" in capsys.readouterr().out


@pytest.mark.parametrize("field, value", [("nodes", 0), ("gpu_memory", -5 * GIB),
                                          ("peak_flops", float("nan")),
                                          ("matmul_efficiency", 0.0), ("inter_node_bw", -1.0),
                                          ("memory_efficiency", 1.5)])
def test_cluster_refuses_what_no_machine_has(field, value):
    from megalite.config import ConfigError

    with pytest.raises(ConfigError, match=f"cluster {field} must be"):
        Cluster(**{**vars(preset("h100", 1)), field: value})


def test_zbv_terms_follow_the_schedule():
    """ZB-V: every rank holds at most 2p half-stage chunks (1F1B's rank-0 peak in bytes)
    and a sixth of 1F1B's bubble once m >= p; the output layer sits on rank 0."""
    assert [peak_in_flight(4, r, 8, vpp=2, schedule="zbv") for r in range(4)] == [8] * 4
    assert bubble_fraction(4, 8, vpp=2, schedule="zbv") == pytest.approx(3 / 48)
    assert bubble_fraction(8, 16, vpp=2, schedule="zbv") == pytest.approx(7 / 96)
    cfg = parse_args(SMALL + ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                              "zbv"]).validate(8)
    ofob = parse_args(SMALL + ["--pipeline-model-parallel-size", "4"]).validate(8)
    # rank 0 holds the embedding and the output layer; the last rank neither
    assert estimate_memory(cfg, 8, 0).total > estimate_memory(ofob, 8, 0).total
    assert estimate_memory(cfg, 8, 3).total < estimate_memory(ofob, 8, 3).total


def test_search_ranks_zbv_beside_interleaved():
    """With two chunks per rank the search tries interleaved 1F1B and ZB-V: ZB-V's bubble
    is a third of interleaved's at vpp 2, so it ranks first; its flags select it."""
    base = parse_args(SMALL)
    cands = search(base, preset("h100", 1), tp=[1], pp=[4], vpp=[2], micro_batch_sizes=(1,),
                   strategies=("no_shard",), recomputes=("none",), overlaps=(False,),
                   schedules=("1f1b", "zbv"))
    assert [c.schedule for c in cands] == ["zbv", None]
    zbv, interleaved = cands
    assert zbv.time.bubble == pytest.approx(interleaved.time.bubble / 3)
    assert zbv.time.step < interleaved.time.step
    assert "zbv" in zbv.name()
    assert parse_args(SMALL + zbv.launch_flags()).validate(8).parallel.pipeline_schedule \
        == "zbv"


def test_memory_efficiency_scales_the_memory_bound_work():
    """``--memory-efficiency`` sets the fraction of the memory bandwidth the memory-bound
    terms run at (the GPU presets' 0.3 by default): halving it adds exactly that work
    again to the step, and the GEMMs' time does not move."""
    import dataclasses

    from megalite.planner.cluster import GPU_MEMORY_EFFICIENCY
    from megalite.planner.time import estimate_time

    tool = load_tool("plan_layout")

    def cluster(*flags):
        return tool.build_cluster(tool._parser().parse_args(list(flags)))

    assert cluster().memory_efficiency == GPU_MEMORY_EFFICIENCY
    mine = cluster("--memory-efficiency", "0.6")
    assert mine.memory_efficiency == 0.6 and mine.memory_rate == 0.6 * mine.memory_bw
    cfg = parse_args(SMALL)
    full = estimate_time(cfg, 8, mine)
    half = estimate_time(cfg, 8, dataclasses.replace(mine, memory_efficiency=0.3))
    gemms = estimate_time(cfg, 8, dataclasses.replace(mine, memory_bw=float("inf")))
    assert half.step > full.step > gemms.step
    assert half.step - gemms.step == pytest.approx(2 * (full.step - gemms.step), rel=1e-9)
