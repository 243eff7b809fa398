#!/usr/bin/env bash
# Pretrain a tiny Llama-style GPT on the bundled corpus with 2 CPU processes (gloo).
# This is what `make pretrain` runs: a few hundred iterations in a few minutes, loss falling
# from ~9 (ln 8000) to ~5, a checkpoint in $OUT/checkpoints. Re-running resumes from it.
#
#   bash scripts/pretrain_tiny_cpu.sh                 # defaults below
#   TRAIN_ITERS=50 TP=1 bash scripts/pretrain_tiny_cpu.sh --log-interval 5   # extra flags appended
set -euo pipefail

# ---- what you usually change ----------------------------------------------------------
NPROC=${NPROC:-2}                 # processes (CPU ranks)
TP=${TP:-2}                       # tensor parallel size (NPROC / TP is data parallel)
TRAIN_ITERS=${TRAIN_ITERS:-300}
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
SEQ_LEN=${SEQ_LEN:-128}
LR=${LR:-3e-3}
OUT=${OUT:-runs/pretrain_tiny_cpu}   # checkpoints, metrics.jsonl, tensorboard
# ----------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
# shellcheck source=scripts/_forward_sigterm.sh
source scripts/_forward_sigterm.sh
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

MODEL=(
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 352
  --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64
)
DATA=(
  --data-path data/kjv_text_document --split 98,2,0
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/kjv_bpe_8k.model
)
TRAINING=(
  --tensor-model-parallel-size "$TP" --distributed-backend gloo
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 3e-4 --lr-decay-style cosine
  --lr-warmup-iters 30 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
  --eval-interval 100 --eval-iters 5
)
OUTPUT=(
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 100
  --log-interval 10 --metrics-jsonl "$OUT/metrics.jsonl" --tensorboard-dir "$OUT/tensorboard"
  --exit-signal-handler
)

# OMP_NUM_THREADS=1: one core per rank; more threads per rank only fight over 2 cores.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} run_forwarding_sigterm "$PYTHON" -m megalite.launch \
  --standalone --nproc_per_node "$NPROC" \
  pretrain/pretrain_gpt.py "${MODEL[@]}" "${DATA[@]}" "${TRAINING[@]}" "${OUTPUT[@]}" "$@"
