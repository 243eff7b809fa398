#!/usr/bin/env bash
# The checks to run when a GPU is lent, in one call of a few minutes: the CUDA tests, then
# the throughput rows the open work is measured by (docs/gpus.md), each section under its
# own time limit, everything logged to $OUT (default /tmp/gpu_checks).
#
#   bash scripts/gpu_checks.sh                 # on the GPU host, from the repository root
#   SMOKE=1 bash scripts/gpu_checks.sh         # the same sections on a CPU, tiny shapes
#
# It needs torch and transformers on the host; it does not install anything (a lent GPU
# host may have no package index), so it runs the tests as `PYTHONPATH=. python -m pytest`.
# Sections:
#   env        GPU, driver, torch and transformers versions
#   test-gpu   the tests marked gpu (tests/gpu): bf16, fp8 and Muon on CUDA against the CPU
#   fp8        tools/benchmark.py fp8: each linear of one layer in fp8 against bf16
#   step       tools/benchmark.py gpu --compile: bf16 against transformers, fp8 tensorwise,
#              fp8 delayed (its cast needs no amax pass first)
#              and Muon rows, one micro-batch per step
#   muon-accum the bf16 and Muon rows at 16 micro-batches per optimizer step (Muon's
#              Newton-Schulz is fixed per step: its share at a realistic batch)
#   blockwise  the bf16 and fp8 blockwise rows, e4m3 (torch's block-scaled kernel on Hopper)
#   autotune   the bf16 and fp8 tensorwise rows under --compile-mode
#              max-autotune-no-cudagraphs (inductor's tuned GEMMs and fusions)
# Every step row prints its profiled split (GPU busy / idle, GEMMs, the rest).
# The sections' limits sum past one device call's 600 s: SECTIONS picks some, in order,
#   SECTIONS="env test-gpu fp8 step" bash scripts/gpu_checks.sh         # 510 s at most
#   SECTIONS="muon-accum blockwise autotune" bash scripts/gpu_checks.sh  # 570 s at most
set -uo pipefail

OUT=${OUT:-/tmp/gpu_checks}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
start=$SECONDS

if [[ -n "${SMOKE:-}" ]]; then
    BENCH=(--device cpu --small --no-compile --seq-length 32 --steps 1 --warmup 1 --top 0)
    FP8=(--device cpu --small --repeat 1)
    ACCUM=2
    AUTOTUNE=default      # no compile in the smoke run
    BLOCK=(--ffn-hidden-size 384 --seq-length 64 --num-query-groups 4)   # 128-blocks tile
else
    BENCH=(--steps 5 --warmup 3 --top 10)
    FP8=(--repeat 10)
    ACCUM=16
    AUTOTUNE=max-autotune-no-cudagraphs
    BLOCK=()
fi

SECTIONS=${SECTIONS:-env test-gpu fp8 step muon-accum blockwise autotune}

section() {   # section NAME LIMIT_SECONDS COMMAND...: run under a limit, log, keep going
    local name=$1 limit=$2
    shift 2
    [[ " $SECTIONS " == *" $name "* ]] || return 0
    echo "=== [$((SECONDS - start))s] $name (limit ${limit}s)" | tee -a "$OUT/log.txt"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.txt" >> "$OUT/log.txt"
    echo "--- $name rc=$rc" | tee -a "$OUT/log.txt"
}

section env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv 2>/dev/null || echo 'no nvidia-smi'; $PY -c 'import torch, transformers; \
print(torch.__version__, transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA\")'"
section test-gpu 150 "$PY" -m pytest -q -rs -m gpu tests/gpu
section fp8 90 "$PY" tools/benchmark.py fp8 "${FP8[@]}"
section step 240 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --fp8-recipe tensorwise,delayed --muon
section muon-accum 180 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --no-hf --muon \
    --grad-accum "$ACCUM"
section blockwise 150 "$PY" tools/benchmark.py gpu "${BENCH[@]}" "${BLOCK[@]}" --no-hf \
    --top 0 --fp8-recipe blockwise --fp8-format e4m3
section autotune 240 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --no-hf --top 0 \
    --fp8-recipe tensorwise --compile-mode "$AUTOTUNE"
echo "=== [$((SECONDS - start))s] done; logs in $OUT" | tee -a "$OUT/log.txt"
