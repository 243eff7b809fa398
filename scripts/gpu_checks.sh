#!/usr/bin/env bash
# The checks to run when a GPU is lent: the CUDA tests, then the throughput rows the open
# work is measured by (docs/gpus.md), most wanted first, each section under its own time
# limit and all of them under one budget, everything logged to $OUT (default
# /tmp/gpu_checks): log.txt (each section's last 150 lines) and sections.tgz (each
# section's whole output).
#
#   bash scripts/gpu_checks.sh                 # on the GPU host, from the repository root
#   SMOKE=1 bash scripts/gpu_checks.sh         # the same sections on a CPU, tiny shapes
#
# It needs torch and transformers on the host; it does not install anything (a lent GPU
# host may have no package index), so it runs the tests as `PYTHONPATH=. python -m pytest`.
# Sections, in the order they run:
#   env        GPU, driver, torch and transformers versions
#   test-gpu   the tests marked gpu (tests/gpu): bf16, fp8 and Muon on CUDA against the CPU
#   step       tools/benchmark.py gpu --compile at the 1.1B shape, one micro-batch per
#              step: bf16, fp8 tensorwise and fp8 delayed (its cast needs no amax pass
#              first), each fp8 row with its ceiling at this shape and its top kernels
#              (delayed idled 13 ms a step more than tensorwise on an H200)
#   fp8-accum  the bf16 and fp8 tensorwise rows at 16 micro-batches per optimizer step
#              (the optimizer and the weights' quantisation, once per step, amortised)
#   wide       the bf16 and fp8 tensorwise rows at --wide (Llama-3 8B's layer, where the
#              GEMMs are a larger share of the step)
#   blockwise  the bf16 and fp8 blockwise rows, e4m3 (torch's block-scaled kernel on Hopper)
#   muon-accum the bf16 and Muon rows at 16 micro-batches per optimizer step (Muon's
#              Newton-Schulz is fixed per step: its share at a realistic batch)
#   fp8        tools/benchmark.py fp8: each linear of one layer in fp8 against bf16
#   transformers  the bf16 row against transformers (fp32 weights under autocast)
# and, only when SECTIONS names it (on an H200 its bf16 row compiled for 137 s and then
# ran as the default mode's, 129.3 against 129.9 ms a step; its fp8 row did not finish):
#   autotune   the bf16 and fp8 tensorwise rows under --compile-mode
#              max-autotune-no-cudagraphs (inductor's tuned GEMMs and fusions)
# Every step row prints its profiled split (GPU busy / idle, GEMMs, the rest).
# BUDGET (seconds, default 560) bounds the whole run, to fit one device call (timeout_s
# 590): a section gets its own limit or what is left of the budget, and one that would get
# under two thirds of its limit (or a minute) is skipped, not cut short; the last line
# names the skipped ones, which SECTIONS then runs in a second call if device time is left:
#   bash scripts/gpu_checks.sh                                    # one call, 560 s at most
#   BUDGET=200 SECTIONS="muon-accum fp8" bash scripts/gpu_checks.sh
set -uo pipefail

OUT=${OUT:-/tmp/gpu_checks}
PY=${PY:-python3}
# each section's output goes to $SECTION_DIR/NAME.txt, packed after every section into
# $OUT/sections.tgz; $OUT itself keeps two files (the device tool brings back at most 8)
SECTION_DIR=${SECTION_DIR:-$OUT/sections}
mkdir -p "$OUT" "$SECTION_DIR"
export PYTHONPATH=${PYTHONPATH:-.}
start=$SECONDS

if [[ -n "${SMOKE:-}" ]]; then
    BENCH=(--device cpu --small --no-compile --seq-length 32 --steps 1 --warmup 1 --top 0)
    FP8=(--device cpu --small --repeat 1)
    ACCUM=2
    AUTOTUNE=default      # no compile in the smoke run
    BLOCK=(--ffn-hidden-size 384 --seq-length 64 --num-query-groups 4)   # 128-blocks tile
    WIDE=(--hidden-size 256 --ffn-hidden-size 512)
    ACCUMS=()
else
    BENCH=(--steps 5 --warmup 3 --top 10)
    FP8=(--repeat 10)
    ACCUM=16
    AUTOTUNE=max-autotune-no-cudagraphs
    BLOCK=()
    # a --wide step takes about 0.2 s: its compiles dominate, fewer steps do
    WIDE=(--wide --steps 3 --warmup 2)
    # a 16-micro-batch step takes about 1.8 s
    ACCUMS=(--steps 3 --warmup 2)
fi

SECTIONS=${SECTIONS:-env test-gpu step fp8-accum wide blockwise muon-accum fp8 transformers}
BUDGET=${BUDGET:-560}
skipped=()

section() {   # section NAME LIMIT_SECONDS COMMAND...: run under a limit, log, keep going
    local name=$1 limit=$2
    shift 2
    [[ " $SECTIONS " == *" $name "* ]] || return 0
    local left=$((BUDGET - (SECONDS - start))) need=$((limit * 2 / 3))
    ((need < 60)) && need=60
    if ((left < need)); then
        skipped+=("$name")
        echo "=== [$((SECONDS - start))s] $name skipped (${left}s of the budget left)" \
            | tee -a "$OUT/log.txt"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "=== [$((SECONDS - start))s] $name (limit ${limit}s)" | tee -a "$OUT/log.txt"
    timeout "$limit" "$@" > "$SECTION_DIR/$name.txt" 2>&1
    local rc=$?
    grep -v "^USDT:" "$SECTION_DIR/$name.txt" | tail -n 150 >> "$OUT/log.txt"
    echo "--- $name rc=$rc" | tee -a "$OUT/log.txt"
    tar czf "$OUT/sections.tgz" -C "$SECTION_DIR" .
}

section env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv 2>/dev/null || echo 'no nvidia-smi'; $PY -c 'import torch, transformers; \
print(torch.__version__, transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else \"no CUDA\")'"
section test-gpu 120 "$PY" -m pytest -q -rs -m gpu tests/gpu
section step 170 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --no-hf \
    --fp8-recipe tensorwise,delayed --top-rows 3
section fp8-accum 120 "$PY" tools/benchmark.py gpu "${BENCH[@]}" "${ACCUMS[@]}" --no-hf \
    --top 0 --fp8-recipe tensorwise --grad-accum "$ACCUM"
section wide 180 "$PY" tools/benchmark.py gpu "${BENCH[@]}" "${WIDE[@]}" --no-hf --top 0 \
    --fp8-recipe tensorwise
section blockwise 120 "$PY" tools/benchmark.py gpu "${BENCH[@]}" "${BLOCK[@]}" --no-hf \
    --top 0 --fp8-recipe blockwise --fp8-format e4m3
section muon-accum 150 "$PY" tools/benchmark.py gpu "${BENCH[@]}" "${ACCUMS[@]}" --no-hf \
    --top 0 --muon --grad-accum "$ACCUM"
section fp8 90 "$PY" tools/benchmark.py fp8 "${FP8[@]}"
section autotune 200 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --no-hf --top 0 \
    --fp8-recipe tensorwise --compile-mode "$AUTOTUNE"
section transformers 120 "$PY" tools/benchmark.py gpu "${BENCH[@]}" --top 0 --no-split
[[ "$SECTION_DIR" == "$OUT/sections" ]] && rm -rf "$SECTION_DIR"   # (packed)
echo "=== [$((SECONDS - start))s] done; logs in $OUT (log.txt, sections.tgz); skipped: \
${skipped[*]:-none}" | tee -a "$OUT/log.txt"
