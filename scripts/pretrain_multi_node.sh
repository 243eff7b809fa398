#!/usr/bin/env bash
# Pretrain on several nodes with torchrun's c10d rendezvous. Run the same command on every
# node (SLURM: scripts/pretrain_slurm.sbatch does it for you):
#
#   NNODES=4 MASTER_ADDR=node0.cluster DATA_PATH=... TOKENIZER_MODEL=... \
#     bash scripts/pretrain_multi_node.sh [extra flags for pretrain/pretrain_gpt.py...]
#
# CHECKPOINT_DIR and RUN_DIR must be on a filesystem every node sees (rank 0 writes the
# metadata and the `latest` pointer; every model-parallel rank writes its own file).
#
# Recovery. A worker or node that dies makes every torchrun restart the job (MAX_RESTARTS
# times); it resumes from the latest checkpoint on the nodes present. A node started again
# (same command, any host) rejoins; with NNODES=MIN:MAX the job goes on without a node
# that does not return (resharding the checkpoint). The rendezvous lives in the torchrun of
# MASTER_ADDR: losing that node ends the job everywhere. To survive it, serve the
# rendezvous on a host outside the job and point every node at it:
#
#   stable-host$ python -m megalite.rendezvous_server --port 29400
#   every node$  RDZV_ENDPOINT=stable-host:29400 NNODES=4 ... bash scripts/pretrain_multi_node.sh
#
# Ranks: c10d ignores NODE_RANK. Global rank 0 (the node that logs and writes the
# checkpoint metadata) is the node whose address sorts first (host name, or PET_LOCAL_ADDR).
#
# torchrun options have no flags here; set them as PET_<OPTION> variables, e.g.
#   PET_LOCAL_ADDR=10.0.0.5      the address this node advertises (default: its host name;
#                                python -m megalite.launch sets it, and GLOO_SOCKET_IFNAME /
#                                NCCL_SOCKET_IFNAME, when the host name resolves to loopback)
#   PET_RDZV_CONF=join_timeout=900,last_call_timeout=30   how long the nodes wait for each other
#   PET_MONITOR_INTERVAL=1       how often torchrun checks its workers (seconds)
#   PET_LOG_DIR=/shared/logs PET_TEE=3   keep each worker's stdout/stderr in files
set -euo pipefail

# ---- what you usually change ----------------------------------------------------------
NNODES=${NNODES:?set NNODES, the number of nodes (or MIN:MAX, elastic)}
MASTER_ADDR=${MASTER_ADDR:-}                  # a node of the job: its torchrun serves the rendezvous
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-${MASTER_ADDR:+$MASTER_ADDR:$MASTER_PORT}}  # or a stable host:port
RDZV_ID=${RDZV_ID:-megalite}                  # one per job: jobs sharing an endpoint must differ
MAX_RESTARTS=${MAX_RESTARTS:-3}               # job restarts after a lost worker or node
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}  # ranks per node (CPU nodes: processes)
TP=${TP:-8}                                   # tensor parallel: keep it within a node
PP=${PP:-1}                                   # pipeline parallel
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
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
# the model: ~8B Llama-style in bf16 unless MODEL_ARGS (a string of flags) replaces it
read -r -d "" -a MODEL <<< "${MODEL_ARGS:---num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights --bf16}" || true
# ----------------------------------------------------------------------------------------

if [ -z "$RDZV_ENDPOINT" ]; then
  echo "set MASTER_ADDR (a node of the job) or RDZV_ENDPOINT (host:port of a rendezvous server)" >&2
  exit 2
fi
if [ -n "${NODE_RANK:-}" ]; then
  echo "megalite: NODE_RANK=$NODE_RANK is ignored: c10d gives global rank 0 to the node whose" \
       "address sorts first" >&2
fi

cd "$(dirname "$0")/.."
# shellcheck source=scripts/_forward_sigterm.sh
source scripts/_forward_sigterm.sh
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python   # the project's own (make install)
fi

# shellcheck disable=SC2206  # DATA_PATH may be a weighted blend: "0.3 a 0.7 b"
DATA=($DATA_PATH)
SP=()
[ "$TP" -gt 1 ] && SP=(--sequence-parallel)

ARGS=(
  "${MODEL[@]}"
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --hidden-dropout 0.0 --attention-dropout 0.0
  # data
  --data-path "${DATA[@]}" --split 969,30,1
  --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
  # parallelism and optimization
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${SP[@]}"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 3e-5 --lr-decay-style cosine
  --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --clip-grad 1.0 --eval-interval 1000 --eval-iters 20
  # output
  --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$SAVE_INTERVAL"
  --log-interval 10 --metrics-jsonl "$RUN_DIR/metrics.jsonl"
  --tensorboard-dir "$RUN_DIR/tensorboard" --exit-signal-handler
)

# python -m megalite.launch is torchrun, with restarts that work across hosts and the
# loopback-host-name check (megalite/launch.py)
run_forwarding_sigterm "$PYTHON" -m megalite.launch \
  --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" \
  --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "$RDZV_ID" \
  pretrain/pretrain_gpt.py "${ARGS[@]}" "$@"
