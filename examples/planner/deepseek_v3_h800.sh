#!/bin/bash
# DeepSeek-V3 (671B parameters, 37B active per token: multi-latent attention, 3 dense layers
# then 58 MoE layers of 256 fine-grained routed experts, top-8, and one shared expert) on
# 2048 H800 (256 nodes): tp1 pp16 ep64 dp128 with ZeRO-1, seq 4096, global batch 15360
# (the batch the run ends with). Published (DeepSeek-AI, "DeepSeek-V3 Technical Report",
# arXiv:2412.19437, sections 3.2 and 4.2, table 1): 671B total / 37B activated parameters,
# "16-way Pipeline Parallelism, 64-way Expert Parallelism spanning 8 nodes, and ZeRO-1 Data
# Parallelism", 180K H800 GPU hours per trillion tokens (1,543 tokens/s per GPU), trained in
# FP8 with DualPipe and one MTP module. The planner models neither FP8 GEMMs nor DualPipe nor
# the MTP module: this row pins the parameter count and a BF16 1F1B estimate of that layout.
# The first stage holds one layer (and the embedding), the other fifteen four each.
# Compared in docs/planner.md.
cd "$(dirname "$0")/../.." && exec .venv/bin/python tools/plan_layout.py --preset h800 \
    --nodes 256 --tp 1 --pp 16 --ep 64 --cp 1 --vpp 1 --micro-batch-sizes 1 \
    --recompute none full --strategies optim --offload-fractions 0 \
    --pipeline-schedules 1f1b --top 2 --show-infeasible 1 -- \
    --num-layers 61 --decoder-first-pipeline-num-layers 1 --hidden-size 7168 \
    --ffn-hidden-size 18432 --num-attention-heads 128 --multi-latent-attention \
    --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 \
    --v-head-dim 128 --kv-channels 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 \
    --mscale-all-dim 1.0 --normalization RMSNorm --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights --position-embedding-type rope --num-experts 256 \
    --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 \
    --moe-layer-freq "[0]*3+[1]*58" --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias --moe-router-num-groups 8 --moe-router-group-topk 4 \
    --moe-router-topk-scaling-factor 2.5 --vocab-size 129280 --seq-length 4096 \
    --max-position-embeddings 4096 --global-batch-size 15360 --bf16 --hidden-dropout 0 \
    --attention-dropout 0
