#!/usr/bin/env bash
# Pretrain on several nodes with torchrun's c10d rendezvous. Run the same command on every
# node, changing only NODE_RANK:
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0.cluster bash scripts/pretrain_multi_node.sh
#   NNODES=4 NODE_RANK=1 MASTER_ADDR=node0.cluster bash scripts/pretrain_multi_node.sh
#   ...
#
# CHECKPOINT_DIR and RUN_DIR must be on a filesystem every node sees (rank 0 writes the
# metadata and the `latest` pointer; every model-parallel rank writes its own file).
set -euo pipefail

# ---- what you usually change ----------------------------------------------------------
NNODES=${NNODES:?set NNODES, the number of nodes}
NODE_RANK=${NODE_RANK:?set NODE_RANK, this node index 0..NNODES-1}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR, the host name of node 0}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-8}                                   # tensor parallel: keep it within a node
PP=${PP:-1}                                   # pipeline parallel (1 until the loop drives pipelines)
DATA_PATH=${DATA_PATH:?set DATA_PATH, a .bin/.idx prefix (or a weighted blend)}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/gpt_multi_node}
RUN_DIR=${RUN_DIR:-runs/gpt_multi_node}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-1024}
SEQ_LEN=${SEQ_LEN:-4096}
TRAIN_ITERS=${TRAIN_ITERS:-100000}
LR=${LR:-3e-4}
# ----------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
# shellcheck source=scripts/_forward_sigterm.sh
source scripts/_forward_sigterm.sh
PYTHON=${PYTHON:-python}

MODEL=(   # ~8B Llama-style
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --hidden-dropout 0.0 --attention-dropout 0.0 --bf16
)
DATA=(
  --data-path $DATA_PATH --split 969,30,1
  --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
)
TRAINING=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --sequence-parallel
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 3e-5 --lr-decay-style cosine
  --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --clip-grad 1.0 --eval-interval 1000 --eval-iters 20
)
OUTPUT=(
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 500
  --log-interval 10 --metrics-jsonl "$RUN_DIR/metrics.jsonl"
  --tensorboard-dir "$RUN_DIR/tensorboard" --exit-signal-handler
)

run_forwarding_sigterm "$PYTHON" -m megalite.launch \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id megalite \
  pretrain/pretrain_gpt.py "${MODEL[@]}" "${DATA[@]}" "${TRAINING[@]}" "${OUTPUT[@]}" "$@"
