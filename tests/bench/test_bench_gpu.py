"""tools/benchmark.py gpu: its whole code path (megalite's bf16 training step with fp32
masters, transformers under autocast, MFU, the kernel profile) runs in its CPU smoke mode,
so it does not rot on machines without a GPU. Speed is not asserted here."""

import re

import pytest
import torch

from tools.bench import gpu as bench


def test_smoke_mode_on_cpu_times_both_and_profiles(capsys):
    bench.main(["--device", "cpu", "--small", "--no-compile", "--seq-length", "32",
                       "--steps", "1", "--warmup", "1", "--top", "20"])
    out = capsys.readouterr().out
    first = {m[0]: float(m[1]) for m in re.findall(
        r"^\s*(megalite|transformers): .* first loss ([0-9.]+)", out, re.M)}
    assert set(first) == {"megalite", "transformers"}, out
    # the same weights and inputs: the first losses agree to bf16 rounding, near ln(vocab)
    assert abs(first["megalite"] - first["transformers"]) < 0.05
    assert abs(first["megalite"] - torch.log(torch.tensor(1024.0)).item()) < 0.5
    assert re.search(r"megalite / transformers: [0-9.]+x tokens/s", out)
    # (the top 20 by self CPU time: the matmuls are among them however loaded the host is;
    # in a top 3 other ops could outrank them on a busy machine)
    assert "top 20 kernels of megalite's step" in out and "aten::mm" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the real benchmark")
def test_without_cuda_one_line_and_success(capsys):
    bench.main([])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "needs CUDA" in out[0]


def test_smoke_mode_times_fp8_and_muon_rows_against_bf16(capsys):
    bench.main(["--device", "cpu", "--small", "--no-compile", "--no-hf", "--seq-length", "32",
                "--steps", "1", "--warmup", "1", "--top", "5", "--top-rows", "2",
                "--fp8-recipe", "tensorwise,mxfp8", "--muon"])
    out = capsys.readouterr().out
    # the first two rows' kernel profiles, and only theirs
    tables = re.findall(r"^top 5 kernels of (\S+)'s step", out, re.M)
    assert tables == ["megalite", "megalite+fp8-tensorwise"], out
    first = {m[0]: float(m[1]) for m in re.findall(
        r"^\s*(megalite\S*): .* first loss ([0-9.]+)", out, re.M)}
    assert set(first) == {"megalite", "megalite+fp8-tensorwise", "megalite+fp8-mxfp8",
                          "megalite+muon"}, out
    # one seed, one batch: the first loss is the bf16 model's up to fp8 rounding
    assert first["megalite+muon"] == first["megalite"]
    for recipe in ("tensorwise", "mxfp8"):
        assert 0 < abs(first[f"megalite+fp8-{recipe}"] - first["megalite"]) < 0.02
        assert re.search(rf"megalite\+fp8-{recipe} / megalite: [0-9.]+x tokens/s", out)
    assert re.search(r"megalite\+muon / megalite: [0-9.]+x tokens/s", out)
    assert re.search(r"Muon's step overhead at 1 micro-batches per step: [+-][0-9.]+ ms, "
                     r"[+-][0-9.]+% of its step", out)
    # each row's split of a profiled step: the GEMMs' share of the ops' time
    for name in first:
        op, gemm, ops = re.search(rf"^\s*{re.escape(name)}: per step ([0-9.]+) ms of CPU op "
                                  r"time, GEMMs ([0-9.]+) ms, ([0-9]+) ops", out, re.M).groups()
        assert 0 < float(gemm) < float(op) and int(ops) > 100


def test_split_line_on_a_gpu_names_the_idle_time():
    line = bench.split_line("fp8", {"span": 134e3, "busy": 114e3, "gemm": 38e3,
                                    "kernels": 2400, "short": 900}, True)
    assert line.endswith("fp8: per step (profiled) GPU busy 114.0 of 134.0 ms (idle 20.0 ms), "
                         "GEMMs 38.0 ms, the rest 76.0 ms; 2400 kernels, 900 of them under "
                         "10 us")


def test_grad_accum_shares_muons_fixed_newton_schulz(capsys):
    """``--grad-accum 2``: two micro-batches per step, the same first loss (the same batch
    twice, averaged), twice the step's model FLOPs against the same Newton-Schulz FLOPs."""
    shares = {}
    for accum in (1, 2):
        bench.main(["--device", "cpu", "--small", "--no-compile", "--no-hf", "--no-bf16",
                    "--seq-length", "32", "--steps", "1", "--warmup", "1", "--top", "0",
                    "--muon", "--grad-accum", str(accum)])
        out = capsys.readouterr().out
        step = float(re.search(r"; ([0-9.e+]+) GFLOP/step", out)[1])
        ns, share = re.search(r"Newton-Schulz ([0-9.e+]+) GFLOP per step .* = ([0-9.]+)% of",
                              out).groups()
        first = float(re.search(r"megalite\+muon: .* first loss ([0-9.]+)", out)[1])
        shares[accum] = (step, float(ns), float(share), first)
        assert f"x {accum} micro-batches per step" in out
    (step1, ns1, share1, first1), (step2, ns2, share2, first2) = shares[1], shares[2]
    assert ns1 == ns2 > 0 and step2 == pytest.approx(2 * step1, rel=1e-3)
    assert share2 == pytest.approx(share1 / 2, rel=0.05)
    assert first2 == pytest.approx(first1, abs=1e-3)


def test_gpu_checks_script_parses_and_its_flags_exist():
    """scripts/gpu_checks.sh (what a lent GPU runs): valid bash, and every benchmark flag
    it passes is one the benchmarks take (its smoke run, SMOKE=1, is in the slow suite)."""
    import pathlib
    import shlex
    import subprocess

    from tools.bench import fp8 as fp8_bench

    script = pathlib.Path(__file__).parents[2] / "scripts" / "gpu_checks.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    arrays = re.findall(r"^\s*(BENCH|FP8|BLOCK|WIDE|ACCUMS)=\((.*)\)$", text, re.M)
    assert {name for name, _ in arrays} == {"BENCH", "FP8", "BLOCK", "WIDE", "ACCUMS"}
    for name, value in arrays:     # the smoke run's and the GPU's
        if name == "FP8":
            fp8_bench.parse(shlex.split(value))
        else:
            bench.parse(shlex.split(value) + ["--fp8-recipe", "tensorwise", "--muon",
                                              "--no-hf", "--grad-accum", "16"])
    # each benchmark gpu command, its continuation lines joined, its scalars given values
    # and its arrays (checked above) left out
    commands = re.findall(r'benchmark\.py gpu "\$\{BENCH\[@\]\}"((?:[^\n]*\\\n)*[^\n]*)',
                          text)
    assert len(commands) == 7
    values = {'"$ACCUM"': "16", '"$AUTOTUNE"': "max-autotune-no-cudagraphs", "\\\n": " "}
    for line in commands:
        for var, value in values.items():
            line = line.replace(var, value)
        bench.parse([f for f in shlex.split(line) if not f.startswith("$")])


@pytest.mark.slow
def test_gpu_checks_script_smoke(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys
    import tarfile

    root = pathlib.Path(__file__).parents[2]
    env = {**os.environ, "SMOKE": "1", "OUT": str(tmp_path), "PY": sys.executable,
           "BUDGET": "3000"}
    subprocess.run(["bash", "scripts/gpu_checks.sh"], cwd=root, env=env, check=True,
                   timeout=600)
    log = (tmp_path / "log.txt").read_text()
    default = ("env", "test-gpu", "step", "fp8-accum", "wide", "blockwise", "muon-accum",
               "fp8", "transformers")
    for name in default:
        assert f"--- {name} rc=0" in log, log
    assert "autotune" not in log      # only where SECTIONS names it
    assert log.rstrip().endswith("skipped: none"), log
    assert "Muon's theory" in log and "megalite+fp8-blockwise / megalite" in log
    # two files come back (the device tool takes at most 8): the log and every section's
    # whole output, packed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "sections.tgz"]
    with tarfile.open(tmp_path / "sections.tgz") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames() if n != ".")
        muon = tar.extractfile("./muon-accum.txt").read().decode()
    assert names == sorted(f"{n}.txt" for n in default)
    assert "Muon's step overhead at 2 micro-batches per step" in muon
    # SECTIONS picks sections: the others are not run
    picked = tmp_path / "picked"
    subprocess.run(["bash", "scripts/gpu_checks.sh"], cwd=root, check=True, timeout=300,
                   env={**env, "OUT": str(picked), "SECTIONS": "env autotune"})
    assert "--- autotune rc=0" in (picked / "log.txt").read_text()
    with tarfile.open(picked / "sections.tgz") as tar:
        assert sorted(n for n in tar.getnames() if n != ".") == ["./autotune.txt",
                                                                  "./env.txt"]
    # a budget too small for a section skips it and names it last
    tight = tmp_path / "tight"
    subprocess.run(["bash", "scripts/gpu_checks.sh"], cwd=root, check=True, timeout=300,
                   env={**env, "OUT": str(tight), "SECTIONS": "env step", "BUDGET": "59"})
    log = (tight / "log.txt").read_text()
    assert "env skipped (59s of the budget left)" in log and "rc=" not in log, log
    assert log.rstrip().endswith("skipped: env step"), log


def test_graph_breaks_line_counts_and_names_the_commonest_reason():
    """A compiled row's line under it: the breaks dynamo counted, and the commonest
    reason's first two lines (how a skipped ``torch._scaled_mm`` showed on torch 2.11)."""
    breaks = bench.counters["graph_break"]
    saved = dict(breaks)
    try:
        breaks.clear()
        assert bench.graph_breaks("megalite+compile").endswith("graph breaks 0")
        breaks["Attempted to call function marked as skipped\n  Explanation: Dynamo does "
               "not know how to trace the builtin `torch._scaled_mm`.\n  Hint: ..."] = 29
        breaks["another reason"] = 1
        line = bench.graph_breaks("fp8")
        assert "graph breaks 30, 29 of them: Attempted to call function marked as " \
               "skipped / Explanation: Dynamo does not know how to trace the builtin " \
               "`torch._scaled_mm`." in line and "Hint" not in line
    finally:
        breaks.clear()
        breaks.update(saved)


def test_fp8_ceiling_swaps_only_the_linears_gemms():
    """The H200's profile of 2026-11-27 in round numbers: bf16 138 ms (busy 125, GEMMs 65),
    fp8 134 ms (busy 114, fp8 GEMMs 30 plus the output layer's 4 in bf16): bf16's step
    with its linears' 61 ms of GEMMs at fp8's 30 is 107 ms, 1.29x; the fp8 row is 27 ms
    over that, 20 of them more kernels and 7 more idle."""
    bf16 = {"span": 138e3, "busy": 125e3, "gemm": 65e3, "ops": {"aten::mm": 65e3}}
    fp8 = {"span": 134e3, "busy": 114e3, "gemm": 34e3,
           "ops": {"aten::mm": 4e3, "aten::_scaled_mm": 30e3}}
    line = bench.fp8_ceiling("fp8", bf16, fp8)
    assert line.endswith(
        "fp8: ceiling: bf16's profiled step 138.0 ms with its linears' GEMMs (61.0 ms) at "
        "this row's fp8 GEMM time (30.0 ms) = 107.0 ms, 1.29x; this row (profiled) 134.0 "
        "ms, 1.03x: +27.0 ms over the ceiling (other kernels +20.0 ms, idle +7.0 ms)")
    # an emulated block recipe ran no fp8 kernel: nothing to say
    assert bench.fp8_ceiling("fp8", bf16, {**fp8, "ops": {"aten::mm": 34e3}}) is None


def test_muon_overhead_is_a_share_of_its_step():
    """The H200's 16-micro-batch rows of 2026-11-27: 1897.4 against 1799.6 ms."""
    assert bench.overhead_line(1.8974, 1.7996, 16) == (
        "Muon's step overhead at 16 micro-batches per step: +97.8 ms, +5.2% of its step "
        "(1897.4 against AdamW's 1799.6 ms)")


def test_busy_time_counts_overlapping_kernels_once():
    """Kernels on two streams overlap (an H200's wide bf16 step summed to 219 ms of kernels
    in a 207 ms span): busy is the union of their intervals, so idle is never negative."""
    assert bench._covered([]) == 0.0
    assert bench._covered([(0, 10), (20, 30)]) == 20
    assert bench._covered([(0, 10), (5, 15), (6, 8), (40, 41)]) == 16
    assert bench._covered([(5, 15), (0, 10)]) == 15
