#!/bin/bash
# Mixtral 8x7B (dropless, top-2 of 8 experts) on 64 H100 80GB (8 nodes): tp1 ep8 pp4 vpp8
# dp16, seq 4096, micro-batch 1, global batch 256, BF16. Published: 468 TFLOP/s per GPU
# (47% of 989) with Megatron-Core v0.9 (NVIDIA/Megatron-LM,
# megatron/core/transformer/moe/README.md: the 468 TFLOPS headline and the "Reference Best
# Parallel Mapping" table; its VP column read as the virtual pipeline size). The
# distributed optimizer is the README's example script's. Compared in docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset h100 --nodes 8 \
    --tp 1 --pp 4 --vpp 8 --ep 8 --micro-batch-sizes 1 --recompute none --strategies optim \
    --offload-fractions 0 --top 1 --show-infeasible 1 -- \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --vocab-size 32000 --seq-length 4096 \
    --max-position-embeddings 32768 --num-experts 8 --moe-router-topk 2 \
    --global-batch-size 256 --bf16 --hidden-dropout 0 --attention-dropout 0
