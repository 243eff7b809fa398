#!/bin/bash
# Megatron-LM's 145.6B GPT on 1536 A100 80GB (192 DGX A100 nodes): tp8 pp8 dp24, batch 2304,
# seq 2048, vocab 51200, mixed precision, activation recomputation. Published: 148 TFLOP/s
# per GPU, 47% of the 312 TFLOP/s peak, counting the recomputed forward (Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21,
# arXiv:2104.04473, Table 1; the same table, model-parallel size 64 without the split, in
# NVIDIA/Megatron-LM's README of April 2021, images/cases_april2021.png at commit 50a4b5f).
# Compared in docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset a100 --nodes 192 \
    --tp 8 --pp 8 --vpp 1 --pipeline-schedules 1f1b --micro-batch-sizes 1 --recompute full \
    --strategies no_shard \
    --offload-fractions 0 --top 1 --show-infeasible 1 -- \
    --num-layers 80 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 \
    --max-position-embeddings 2048 --vocab-size 51200 --global-batch-size 2304 --fp16 \
    --hidden-dropout 0 --attention-dropout 0
