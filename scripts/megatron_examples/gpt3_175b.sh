#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, adapted to megalite on a
# 2-core CPU machine. Every flag of the original is kept; only these changed:
#   sizes        96 -> 4 layers, hidden 12288 -> 64, heads 96 -> 4, seq 2048 -> 64,
#                global batch 1536 -> 16 with the batch-size schedule's thresholds and sizes
#                scaled alike (16 -> 4 samples at first, 16 at the end), 500000 -> 30
#                iterations (decay 430000 -> 26)
#   parallel     8 GPUs, tensor 8 x pipeline 16 -> 2 CPU processes (gloo, chosen
#                automatically without CUDA): tensor 1 x pipeline 2
#   data, paths  GPT-2 style vocab.json/merges.txt of a byte-level BPE trained on the bundled
#                corpus (prepare_data.py), the corpus tokenized with it, runs/ for outputs
#   added        --tokenizer-type GPT2BPETokenizer, which the original leaves out (Megatron-LM
#                itself needs it; its --vocab-file/--merge-file are for this tokenizer)
#
#   bash scripts/megatron_examples/gpt3_175b.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [VOCAB_FILE] [MERGE_FILE] [DATA_PATH]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
EXAMPLES=runs/megatron_examples

GPUS_PER_NODE=2
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-29519}
NUM_NODES=1
NODE_RANK=0

CHECKPOINT_PATH=${1:-"$EXAMPLES/gpt3_175b/checkpoints"}
TENSORBOARD_LOGS_PATH=${2:-"$EXAMPLES/gpt3_175b/tensorboard"}
VOCAB_FILE=${3:-"$EXAMPLES/bpe/vocab.json"}
MERGE_FILE=${4:-"$EXAMPLES/bpe/merges.txt"}
DATA_PATH=${5:-"$EXAMPLES/kjv_bpe_text_document"}
if [ $# -lt 5 ]; then
    "$PYTHON" scripts/megatron_examples/prepare_data.py "$EXAMPLES"
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    --step-batch-size-schedule "0:4 2K:8 4K:12 6K:16"
    --train-iters 30
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 26
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 1
	--pipeline-model-parallel-size 2
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

"$PYTHON" -m torch.distributed.run ${DISTRIBUTED_ARGS[@]} pretrain/pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${@:6}"
