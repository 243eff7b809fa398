#!/usr/bin/env bash
# Pretrain a GPT / Llama model on one node with all its GPUs (torchrun, NCCL).
#
#   DATA_PATH=/data/my_corpus_text_document TOKENIZER_MODEL=/data/tokenizer.model \
#     bash scripts/pretrain_single_node.sh [extra Megatron flags...]
#
# Re-running with the same CHECKPOINT_DIR resumes from the latest checkpoint.
set -euo pipefail

# ---- what you usually change ----------------------------------------------------------
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-2}                                   # tensor parallel (within the node)
PP=${PP:-1}                                   # pipeline parallel (1 until the loop drives pipelines)
DATA_PATH=${DATA_PATH:-data/kjv_text_document}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/kjv_bpe_8k.model}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt_single_node}
RUN_DIR=${RUN_DIR:-runs/gpt_single_node}      # metrics.jsonl, tensorboard
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
SEQ_LEN=${SEQ_LEN:-2048}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
LR=${LR:-3e-4}
# ----------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
# shellcheck source=scripts/_forward_sigterm.sh
source scripts/_forward_sigterm.sh
PYTHON=${PYTHON:-python}

MODEL=(   # ~1B Llama-style
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 5632
  --num-attention-heads 16 --group-query-attention --num-query-groups 8
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --hidden-dropout 0.0 --attention-dropout 0.0 --bf16
)
DATA=(
  --data-path "$DATA_PATH" --split 969,30,1
  --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
)
TRAINING=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 3e-5 --lr-decay-style cosine
  --lr-warmup-fraction 0.01 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --clip-grad 1.0 --eval-interval 1000 --eval-iters 20
)
OUTPUT=(
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000
  --log-interval 10 --metrics-jsonl "$RUN_DIR/metrics.jsonl"
  --tensorboard-dir "$RUN_DIR/tensorboard" --exit-signal-handler
)

run_forwarding_sigterm "$PYTHON" -m megalite.launch \
  --standalone --nproc_per_node "$GPUS_PER_NODE" \
  pretrain/pretrain_gpt.py "${MODEL[@]}" "${DATA[@]}" "${TRAINING[@]}" "${OUTPUT[@]}" "$@"
