#!/bin/bash
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, adapted to megalite on a 2-core
# CPU machine. Every flag of the original is kept; only these changed:
#   sizes        32 -> 2 layers, hidden 4096 -> 64, ffn 14336 -> 224, heads 32 -> 4,
#                query groups 8 -> 2, kv-channels 128 -> 16, seq 8192 -> 128,
#                batch 1 x 128 -> 2 x 16, train/decay/warm-up samples scaled to 40 steps,
#                --vocab-size 128256 -> 8000 (the tokenizer's)
#   parallel     8 GPUs -> 2 CPU processes (gloo, chosen automatically without CUDA)
#   data, paths  a byte-level BPE trained on the bundled corpus (prepare_data.py) as the
#                Hugging Face tokenizer, the corpus tokenized with it, runs/ for outputs
#   DTYPE        bf16 by default (the CPU run is quicker); DTYPE=fp8 runs the original's
#                fp8 lines: megalite's fp8 GEMMs (delayed scaling, hybrid format) run on
#                the CPU too; --fp8-param-gather all-gathers their weights as fp8 bytes
#                under the distributed optimizer (2 processes at tp 1: dp 2)
#
#   bash scripts/megatron_examples/llama3_8b.sh [CHECKPOINT_PATH] [TENSORBOARD_LOGS_PATH] [TOKENIZER|MOCK] [DATA|MOCK]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
EXAMPLES=runs/megatron_examples

CHECKPOINT_PATH=${1:-"$EXAMPLES/llama3_8b/checkpoints"}
TENSORBOARD_LOGS_PATH=${2:-"$EXAMPLES/llama3_8b/tensorboard"}
TOKENIZER_ARG=${3:-"$EXAMPLES/bpe/tokenizer.json"} # Path to tokenizer model, or "MOCK"
DATA_ARG=${4:-"$EXAMPLES/kjv_bpe_text_document"}   # Data prefix, or "MOCK"
if [[ "$TOKENIZER_ARG" != "MOCK" && "$DATA_ARG" != "MOCK" ]]; then
    "$PYTHON" scripts/megatron_examples/prepare_data.py "$EXAMPLES"
fi

mkdir -p "$(dirname "$CHECKPOINT_PATH")"
mkdir -p "$(dirname "$TENSORBOARD_LOGS_PATH")"

GPUS_PER_NODE=2
NUM_NODES=1
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29517}
NODE_RANK=${NODE_RANK:-0}

PRETRAIN_SCRIPT_PATH="pretrain/pretrain_gpt.py"

TP_SIZE=1
CP_SIZE=1
PP_SIZE=1
MICRO_BATCH_SIZE=2
GLOBAL_BATCH_SIZE=16
NUM_LAYERS=2
DTYPE=${DTYPE:-"bf16"}
SEQ_LENGTH=128
MAX_POSITION_EMBEDDINGS=128

DATA_CACHE_PATH="${PWD}/$EXAMPLES/llama3_8b/cache"
mkdir -p "$DATA_CACHE_PATH"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers $NUM_LAYERS
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length $SEQ_LENGTH
    --max-position-embeddings $MAX_POSITION_EMBEDDINGS
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size $MICRO_BATCH_SIZE
    --global-batch-size $GLOBAL_BATCH_SIZE
    --train-samples 640
    --lr-decay-samples 638
    --lr-warmup-samples 32
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid"
        "--fp8-amax-history-len 1024"
        "--fp8-amax-compute-algo max"
        "--fp8-param-gather"
    )
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP_SIZE
    --context-parallel-size $CP_SIZE
    --sequence-parallel
)

DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
TRAINING_ARGS+=("${DDP_ARGS[@]}")

DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=(
        "--mock-data"
        "--tokenizer-type NullTokenizer"
        "--vocab-size 8000"
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--tiktoken-pattern v2"
        "--split 99,1,0"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
    )
else
    DATA_ARGS_LIST+=(
        "--data-path $DATA_ARG"
        "--tokenizer-type HuggingFaceTokenizer"
        "--tokenizer-model $TOKENIZER_ARG"
        "--data-cache-path ${DATA_CACHE_PATH}"
        "--split 99,1,0"
        "--no-create-attention-mask-in-dataloader"
        "--no-mmap-bin-files"
        "--num-workers 1"
        "--vocab-size 8000"
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 32
    --eval-interval 100
    --save-interval 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Error: pretrain_gpt.py not found at $PRETRAIN_SCRIPT_PATH"
    exit 1
fi

"$PYTHON" -m torch.distributed.run ${DISTRIBUTED_ARGS[@]} \
    "$PRETRAIN_SCRIPT_PATH" \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${DTYPE_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS_LIST[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "${@:5}"
