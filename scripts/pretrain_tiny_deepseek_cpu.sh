#!/usr/bin/env bash
# Pretrain a tiny DeepSeek-V3-style model on the bundled corpus with 2 CPU processes (gloo),
# then generate from it: multi-latent attention, one dense layer then MoE layers of 8
# fine-grained experts (top-2, sigmoid scores, the aux-loss-free expert bias) beside a
# shared expert, and one multi-token prediction depth, experts split over the 2 ranks
# (expert parallel 2, data parallel 2). Re-running resumes from $OUT/checkpoints.
#
#   bash scripts/pretrain_tiny_deepseek_cpu.sh                  # defaults below
#   TRAIN_ITERS=20 GENERATE=0 bash scripts/pretrain_tiny_deepseek_cpu.sh --log-interval 5
set -euo pipefail

# ---- what you usually change ----------------------------------------------------------
NPROC=${NPROC:-2}                 # processes (CPU ranks)
EP=${EP:-2}                       # expert parallel size (the experts split over ranks)
TRAIN_ITERS=${TRAIN_ITERS:-200}
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
SEQ_LEN=${SEQ_LEN:-128}
LR=${LR:-3e-3}
GENERATE=${GENERATE:-1}           # 0: no sampled continuations at the end
OUT=${OUT:-runs/pretrain_tiny_deepseek_cpu}   # checkpoints, metrics.jsonl, tensorboard
# ----------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
# shellcheck source=scripts/_forward_sigterm.sh
source scripts/_forward_sigterm.sh
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

MODEL=(
  --num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64
)
MLA=(
  --multi-latent-attention --qk-layernorm --q-lora-rank 64 --kv-lora-rank 32
  --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32
)
MOE=(
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64
  --moe-shared-expert-intermediate-size 64 --moe-layer-freq "[0]*1+[1]*3"
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
  --moe-token-dispatcher-type alltoall --expert-model-parallel-size "$EP"
)
MTP=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
DATA=(
  --data-path data/kjv_text_document --split 98,2,0
  --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model data/kjv_bpe_8k.model
)
TRAINING=(
  --distributed-backend gloo
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 3e-4 --lr-decay-style cosine
  --lr-warmup-iters 20 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
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
  pretrain/pretrain_gpt.py "${MODEL[@]}" "${MLA[@]}" "${MOE[@]}" "${MTP[@]}" "${DATA[@]}" \
  "${TRAINING[@]}" "${OUTPUT[@]}" "$@"

if [ "$GENERATE" != 0 ]; then   # the prediction depth trains the model; generation skips it
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" tools/generate.py --load "$OUT/checkpoints" \
    --prompt "And God said" --num-samples 2 --max-new-tokens 30 --temperature 0.8 \
    --top-p 0.9 --seed 1
fi
