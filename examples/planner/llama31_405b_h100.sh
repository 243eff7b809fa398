#!/bin/bash
# Llama 3.1 405B pre-training on 8192 H100 80GB (1024 nodes): tp8 cp1 pp16 dp64, 126 layers
# (one fewer on the first and the last stage), seq 8192, 16M tokens per batch, BF16.
# Published: 430 TFLOP/s per GPU, 43% BF16 MFU (Llama Team, "The Llama 3 Herd of Models",
# arXiv:2407.21783, Table 4). Micro-batch 1 and the distributed optimizer are this example's
# assumptions; without recomputation megalite's layers would not fit (listed as infeasible),
# so full recomputation is offered too. Compared in docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset h100 --nodes 1024 \
    --tp 8 --pp 16 --vpp 1 --pipeline-schedules 1f1b --cp 1 --micro-batch-sizes 1 \
    --recompute none full --strategies optim \
    --offload-fractions 0 --top 1 --show-infeasible 1 -- \
    --num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --vocab-size 128256 --seq-length 8192 \
    --max-position-embeddings 8192 --global-batch-size 2048 --bf16 --hidden-dropout 0 \
    --attention-dropout 0 --decoder-first-pipeline-num-layers 7 \
    --decoder-last-pipeline-num-layers 7
