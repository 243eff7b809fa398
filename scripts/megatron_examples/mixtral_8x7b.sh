#!/bin/bash
# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, adapted to megalite on a
# 2-core CPU machine. Every flag of the original is kept; only these changed:
#   sizes        32 -> 2 layers, hidden 4096 -> 64, ffn 14336 -> 128, heads 32 -> 4,
#                query groups 8 -> 2, 8 -> 4 experts, seq 4096 -> 128 (max positions 256),
#                global batch 256 -> 16, 500000 -> 30 iterations (decay 320000 -> 20,
#                warm-up 500 -> 2)
#   parallel     8 GPUs x 4 pipeline stages -> 2 CPU processes (gloo, chosen automatically
#                without CUDA): pipeline 4 -> 1, expert parallel 8 -> 2
#   data, paths  the bundled corpus and SentencePiece model, runs/ for outputs
#
#   bash scripts/megatron_examples/mixtral_8x7b.sh [CHECKPOINT_PATH] [TOKENIZER_MODEL] [DATA_PATH]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

GPUS_PER_NODE=2
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29518"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}

CHECKPOINT_PATH=${1:-runs/megatron_examples/mixtral_8x7b/checkpoints}
TOKENIZER_MODEL=${2:-data/kjv_bpe_8k.model}
DATA_PATH=${3:-data/kjv_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 128
    --max-position-embeddings 256
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 99990,8,2
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    --lr 1e-4
    --train-iters 30
    --lr-decay-iters 20
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 2
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 1000 \
    --eval-iters 10 \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY:-}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi

"$PYTHON" -m torch.distributed.run ${DISTRIBUTED_ARGS[@]} pretrain/pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]} \
    "${@:4}"
