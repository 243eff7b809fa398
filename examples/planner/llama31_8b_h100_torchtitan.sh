#!/bin/bash
# Llama 3.1 8B on 8 H100 (one node) as torchtitan publishes it: 1D FSDP over the 8 GPUs
# (megalite: dp8 with --data-parallel-sharding-strategy optim_grads_params), local batch 2,
# global batch 16, seq 8192, selective activation checkpointing, BF16, no torch.compile.
# Published: 5,762 tokens/s per GPU, 82.4 GiB, "33% to 39% MFU" for its 8B runs without
# Float8, on H100s with HBM2e at a 500 W power limit (torchtitan docs/performance.md,
# Table 1, measured at torchtitan 9dec370 of 2024-12-26:
# https://github.com/pytorch/torchtitan/blob/main/docs/performance.md). Compared in
# docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset h100 --nodes 1 \
    --tp 1 --pp 1 --vpp 1 --cp 1 --micro-batch-sizes 2 --recompute selective \
    --strategies optim_grads_params --offload-fractions 0 --top 1 --show-infeasible 1 -- \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --vocab-size 128256 --seq-length 8192 \
    --max-position-embeddings 8192 --global-batch-size 16 --bf16 --hidden-dropout 0 \
    --attention-dropout 0
