#!/bin/bash
# fp8 against bf16 on the bundled run: make pretrain's model and data (ffn 384, so that every
# recipe tiles: blockwise needs multiples of 128), 300 iterations, bf16 and the four fp8
# recipes (hybrid format), the five runs side by side on one device, one rank each.
#
#   OUT=runs/fp8 bash scripts/fp8_convergence.sh                  # one GPU (nccl)
#   OUT=runs/fp8 DEV=cpu BACKEND=gloo bash scripts/fp8_convergence.sh   # CPU: hours
#   .venv/bin/python tools/plot_run.py runs/fp8/* --output fp8.png
#
# Each run writes OUT/<name>/metrics.jsonl (and its checkpoints, tensorboard); its log is
# OUT/<name>.log. ITERS changes the length (at least the 30 warm-up iterations).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/fp8_convergence}
DEV=${DEV:-cuda}
BACKEND=${BACKEND:-nccl}
ITERS=${ITERS:-300}
COMMON=(--save-interval 100000 --bf16 --ffn-hidden-size 384 --device "$DEV"
        --distributed-backend "$BACKEND")
mkdir -p "$OUT"

run() {  # name, extra flags...
  local name=$1; shift
  OUT="$OUT/$name" NPROC=1 TP=1 TRAIN_ITERS="$ITERS" \
    bash scripts/pretrain_tiny_cpu.sh "${COMMON[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, $(grep -c lm_loss "$OUT/$name/metrics.jsonl" 2>/dev/null || echo 0) rows"
}

run bf16 &
for recipe in tensorwise delayed mxfp8 blockwise; do
  run "fp8_$recipe" --fp8-format hybrid --fp8-recipe "$recipe" &
done
wait
