#!/bin/bash
# Llama 2 70B on 64 H100 80GB (8 nodes) as MaxText runs it in NVIDIA's DGX Cloud benchmark
# recipe: FSDP over all 64 GPUs (megalite: dp64 with --data-parallel-sharding-strategy
# optim_grads_params), per-device batch 2, global batch 128, seq 4096, BF16.
# Published: 7.908 s per step, 460.5 TFLOP/s per device, MFU 46.54% with 1.82e15 model
# FLOPs per sequence (NVIDIA NGC catalog, "Maxtext Llama2 70B 25.01.1 (DGXC Benchmarking)",
# March 2025). The recipe does not say its rematerialisation policy, so no and full
# recomputation are both offered. Compared in docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset h100 --nodes 8 \
    --tp 1 --pp 1 --vpp 1 --cp 1 --micro-batch-sizes 2 --recompute none full \
    --strategies optim_grads_params --offload-fractions 0 --top 1 --show-infeasible 1 -- \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm \
    --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --vocab-size 32000 --seq-length 4096 \
    --max-position-embeddings 4096 --global-batch-size 128 --bf16 --hidden-dropout 0 \
    --attention-dropout 0
