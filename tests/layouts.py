"""The layouts of the equivalence tests: one declarative table that every suite reads.

A row (:class:`Layout`) is a world size, the ``ParallelConfig`` fields of the layout, and the
``ModelConfig`` / ``TrainConfig`` overrides the layout needs (a number of experts, enough
layers for the pipeline, micro-batches for the interleaved schedule). Its ``tags`` say
which suite runs it:

==============  ========================================================================
tag             suite
==============  ========================================================================
model           tests/model/test_equivalence.py: tp x sp x recompute, loss and grads
mixtral         tests/model/test_mixtral_parity.py: tp x ep x etp against transformers
moe-layer       tests/moe/test_distributed.py: one MoE layer, ep x tp x etp x cp
moe-training    tests/moe/test_training_equivalence.py: Mixtral training, x dispatcher
optim           tests/optim/test_equivalence.py: dp x tp x pp x distributed optimizer
muon            tests/optim/test_muon_layouts.py: --optimizer muon at tp x sp x pp x vpp x
                dp x sharding strategy x ep x offload, x --muon-tp-mode (duplicated,
                distributed), against the one-process Muon run
lion            tests/optim/test_lion_layouts.py: --optimizer lion (and Muon with
                --muon-scalar-optimizer lion) at tp x sp x pp x vpp x dp x sharding
                strategy x ep x offload, against the one-process run
pipeline        tests/pipeline/test_pipeline_training.py: pp x vpp x tp x sp x dp
training        tests/training/test_resume_and_layouts.py: tp x sp x dp, loss and metrics
cp              tests/context_parallel/test_training_equivalence.py: cp x comm type x tp x
                sp x pp x vpp x dp x distributed optimizer x ep, loss, grad norm, params
resume          exact resumption at one layout (training, pipeline suites)
reshard         tests/checkpoint/test_reshard.py (AdamW) and test_optimizer_reshard.py
                (Muon, Lion):
                save at one layout, resume at others
activation-     tests/model/test_activation_offload.py: --cpu-offloading against the same
offload         layout without it, bitwise (rows tagged ``slow`` outside the default run)
fp8             tests/fp8/test_layouts.py: fp8 GEMMs of each recipe x tp + sp, pp, dp, cp,
                ep, loss, grad norm, params (and the delayed amax histories)
qk-clip         tests/optim/test_qk_clip_layouts.py: --qk-clip (AdamW and Muon) at tp 2 + sp,
                cp 2 (p2p, a2a), pp 2, dp 2 with the distributed optimizer, ZeRO-3, and
                multi-latent attention, loss, grad norm, max attention logit, params
grad-stats      tests/training/test_grad_stats.py: --log-params-norm and
                --log-num-zeros-in-grad at dp x distributed optimizer (with both overlaps,
                ZeRO-3), tp + sp, pp (tied embedding), ep, against the one-process run
==============  ========================================================================

A new parallelism adds its rows here (and a dimension to ``tests/fuzz/draw.py``); a
failing fuzz draw prints a ``Layout(...)`` that can be pasted into the table as a row.
``tests/test_layouts.py`` checks the table itself with megalite's own config validation.
Row names are derived from the fields (``optim-tp2-pp2-dp2-distopt``) and are the pytest
ids of the suites (``ids=str``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tests.layout_row import (  # noqa: F401  (the suites import these from here)
    SHORT,
    Layout,
    parallel_config,
    row,
    run_by_world,
    slug,
    tiny,
)

# -- model: tensor parallelism x sequence parallelism x recomputation (GPT-2 and Llama) ---
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full-uniform": {"recompute_granularity": "full", "recompute_method": "uniform",
                     "recompute_num_layers": 2},
    "full-block": {"recompute_granularity": "full", "recompute_method": "block",
                   "recompute_num_layers": 1},
}
_MODEL = [row("model", tp, kind, model=RECOMPUTE[kind], tp=tp, sp=sp)
          for tp in (1, 2, 4) for sp in ((False,) if tp == 1 else (False, True))
          for kind in RECOMPUTE if (tp, kind) != (1, "none")]   # tp1 / none: the reference

# multi-latent attention (DeepSeek-V3's shape, tiny: both latents, a RoPE part of 4, values
# narrower than keys, YaRN) and QK norm; each row against tp 1 of its own model
MLA = {"multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 16,
       "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6,
       "rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
       "original_max_position_embeddings": 8, "group_query_attention": False,
       "num_query_groups": None}
MLA_RECOMPUTE = {"recompute_granularity": "selective",
                 "recompute_modules": ["core_attn", "mla_up_proj"]}
QK_NORM = {"qk_layernorm": True}
# multi-token prediction: two depths (RoPE: a later pipeline stage holds no position table)
MTP = {"mtp_num_layers": 2, "position_embedding_type": "rope"}
MTP4 = {**MTP, "num_layers": 4}   # a V schedule at pp 2 cuts the layers into 4 pieces
_MODEL += [
    row("model", 2, "mla", model=MLA, tp=2, sp=False),
    row("model", 2, "mla", model=MLA, tp=2, sp=True),
    row("model", 2, "mla-no-q-lora", model={**MLA, "q_lora_rank": None}, tp=2, sp=True),
    row("model", 1, "mla-up-proj", model={**MLA, "recompute_granularity": "selective",
                                          "recompute_modules": ["mla_up_proj"]}),
    row("model", 2, "mla-selective", model={**MLA, **MLA_RECOMPUTE}, tp=2, sp=True),
    row("model", 2, "mla-mlp", model={**MLA, "recompute_granularity": "selective",
                                      "recompute_modules": ["mlp", "mla_up_proj"]},
        tp=2, sp=True),
    row("model", 2, "qk-norm", model=QK_NORM, tp=2, sp=False),
    row("model", 2, "qk-norm", model=QK_NORM, tp=2, sp=True),
    row("model", 2, "layernorm-mlp", model={"recompute_granularity": "selective",
                                            "recompute_modules": ["layernorm", "mlp"]},
        tp=2, sp=True),
]

# -- mixtral: logits against transformers on 4 ranks, dp = 4 / tp ------------------------
_MIXTRAL_MODEL = {"num_experts": 4}
_MIXTRAL = [row("mixtral", 4, model=_MIXTRAL_MODEL, tp=2, sp=False, ep=2, etp=2),
            row("mixtral", 4, model=_MIXTRAL_MODEL, tp=2, sp=True, ep=2, etp=1),
            row("mixtral", 4, model=_MIXTRAL_MODEL, tp=1, sp=False, ep=4, etp=1),
            row("mixtral", 4, model=_MIXTRAL_MODEL, tp=1, sp=False, ep=2, etp=1)]

# -- moe-layer: one MoE layer on 4 ranks, (tp, sp, ep, etp, cp); dp = 4 / (tp x cp) -------
_MOE_LAYER = [row("moe-layer", 4, model={"num_experts": 8}, tp=tp, sp=sp, ep=ep, etp=etp,
                  cp=cp)
              for tp, sp, ep, etp, cp in (
                  (1, False, 1, 1, 1), (1, False, 2, 1, 1), (1, False, 4, 1, 1),
                  (2, True, 1, 1, 1), (2, True, 2, 1, 1), (2, True, 4, 1, 1),
                  (2, True, 1, 2, 1), (2, True, 2, 2, 1),
                  (2, False, 2, 1, 1),                         # tp without sequence parallel
                  (1, False, 2, 1, 2), (2, True, 4, 1, 2))]    # context parallel

# -- moe-training: a tiny Mixtral trained on 4 ranks --------------------------------------
_MOE_TRAINING = [
    *(row("moe-training", 4, dispatcher,
          model={"num_experts": 4, "moe_token_dispatcher_type": dispatcher},
          tp=tp, sp=sp, ep=ep, etp=etp)
      for tp, sp, ep, etp in ((1, False, 1, 1), (1, False, 2, 1), (1, False, 4, 1),
                              (2, True, 1, 2), (2, True, 2, 2), (2, True, 4, 1))
      for dispatcher in ("alltoall", "allgather")),
    # the distributed optimizer with overlapped reduction: expert shards over edp
    row("moe-training", 4, model={"num_experts": 4}, tp=2, sp=True, ep=2, etp=1,
        distopt=True, overlap_grad=True),
    # sharded gradients (expert shards over edp 2, dense over dp 4) and half the optimizer
    # state offloaded to the host
    row("moe-training", 4, "offload0.5", model={"num_experts": 4}, ep=2,
        strategy="optim_grads", overlap_grad=True,
        optim={"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}),
    # ZeRO-3: expert parameters sharded and gathered over edp 2, dense ones over dp 4
    row("moe-training", 4, model={"num_experts": 4}, ep=2, strategy="optim_grads_params"),
    # multi-latent attention in front of the experts
    row("moe-training", 4, "mla", model={"num_experts": 4, **MLA}, tp=2, sp=True, ep=2,
        etp=1),
    # 4 layers, MoE every other one: with pp 2 x vpp 2 the second stage holds no MoE layer
    row("moe-training", 4, model={"num_experts": 4, "num_layers": 4, "moe_layer_freq": 2,
                                  "moe_token_dispatcher_type": "alltoall"},
        pp=2, vpp=2, tp=2, sp=True, ep=2, etp=1),
    # zero bubble: the experts' grouped-GEMM weight gradients wait for the W steps
    row("moe-training", 4, model={"num_experts": 4}, pp=2, tp=2, sp=True, ep=2, etp=1,
        schedule="zb_h1"),
    row("moe-training", 4, model={"num_experts": 4}, ep=2, distopt=True, overlap_grad=True,
        schedule="zb_h1"),
    # ZB-V: the experts of both chunks of a V on each pipeline rank, ep 2 x dp 2
    row("moe-training", 4, model={"num_experts": 4, "num_layers": 4}, pp=2, ep=2,
        schedule="zbv"),
    # --overlap-moe-expert-parallel-comm: each backward paired with the next forward (2
    # micro-batches per dp rank), their expert all-to-alls over ep 2 overlapping the other's
    # compute; with --delay-wgrad-compute the paired backward's weight GEMMs after the pair
    row("moe-training", 2, model={"num_experts": 4}, ep=2, a2a_overlap=True),
    row("moe-training", 2, model={"num_experts": 4}, ep=2, a2a_overlap=True,
        delay_wgrad=True),
    # the same in a pipeline: every backward of the steady state paired, on every stage, a
    # pair waiting for both inputs (1F1B over 4 micro-batches: 2 pairs on stage 0, 3 on
    # stage 1; interleaved over 4 micro-batches of 1: 3 and 5)
    row("moe-training", 4, model={"num_experts": 4}, pp=2, ep=2, a2a_overlap=True,
        train={"global_batch_size": 16}),
    row("moe-training", 4, model={"num_experts": 4, "num_layers": 4}, pp=2, vpp=2, ep=2,
        a2a_overlap=True, delay_wgrad=True, train={"micro_batch_size": 1}),
]

# Qwen3-MoE's shape: QK norm, softmax over all experts then top-k not renormalized
# (norm_topk_prob=False), the first layer dense and wider than the experts
QWEN3_MOE = {"num_experts": 4, "moe_router_topk": 2, "qk_layernorm": True,
             "moe_router_pre_softmax": True, "moe_ffn_hidden_size": 32,
             "moe_layer_freq": "[0]+[1]"}
_MOE_TRAINING += [
    row("moe-training", 4, "qwen3-moe", model=QWEN3_MOE, tp=2, sp=True, ep=2, etp=1),
    row("moe-training", 4, "qwen3-moe", model=QWEN3_MOE, pp=2, ep=2),
]

# -- DeepSeek-V3 routing: sigmoid, 8 experts in 4 groups (top-2 of 2 groups), the expert
# bias (a large rate, so that it moves the choice within the few iterations), shared
# expert, the first layer dense (--moe-layer-freq as a list); trained by the moe-training
# suite, the cp suite and the expert-bias resume (tests/moe/test_expert_bias.py)
DEEPSEEK_MOE = {"num_experts": 8, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
                "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                "moe_router_topk_scaling_factor": 2.5, "moe_router_enable_expert_bias": True,
                "moe_router_bias_update_rate": 0.05, "moe_shared_expert_intermediate_size": 32,
                "moe_layer_freq": "[0]+[1]"}
_DEEPSEEK = [
    row("moe-training", 4, "deepseek", model=DEEPSEEK_MOE, ep=2),
    row("moe-training", 4, "deepseek", model=DEEPSEEK_MOE, tp=2, sp=True, ep=2, etp=1),
    row("moe-training", 4, "deepseek", model=DEEPSEEK_MOE, pp=2, ep=2),
    row("moe-training", 2, "deepseek", model=DEEPSEEK_MOE, ep=2, a2a_overlap=True),
    row("moe-training", 4, "deepseek", model=DEEPSEEK_MOE, tp=2, sp=True, distopt=True),
    # DeepSeek-V3's --recompute-modules (bar mla_up_proj, which needs MLA)
    row("moe-training", 4, "deepseek-recompute", model={
        **DEEPSEEK_MOE, "recompute_granularity": "selective",
        "recompute_modules": ["mlp", "moe", "layernorm"]}, tp=2, sp=True, ep=2, etp=1),
    # --moe-shared-expert-overlap: the shared experts inside the dispatch all-to-all (under
    # tp 2 + SP their own all-gather / reduce-scatter over tp run while it is in flight),
    # also recomputed in backward
    row("moe-training", 2, "deepseek-sharedov",
        model={**DEEPSEEK_MOE, "moe_shared_expert_overlap": True}, ep=2),
    row("moe-training", 4, "deepseek-sharedov",
        model={**DEEPSEEK_MOE, "moe_shared_expert_overlap": True}, tp=2, sp=True, ep=2, etp=1),
    row("moe-training", 4, "deepseek-sharedov-recompute", model={
        **DEEPSEEK_MOE, "moe_shared_expert_overlap": True, "recompute_granularity": "selective",
        "recompute_modules": ["moe"]}, tp=2, sp=True, ep=2, etp=1),
    # multi-token prediction with MLA in front of the experts; its depths' MoE layer (the
    # last layer's kind) has an expert bias of its own: ep 2, and pp 2 (the depths on stage 1)
    row("moe-training", 4, "deepseek-mtp", model={**DEEPSEEK_MOE, **MLA, **MTP}, ep=2),
    row("moe-training", 4, "deepseek-mtp", model={**DEEPSEEK_MOE, **MLA, **MTP}, pp=2,
        ep=2),
    # save at ep 2 x dp 2, resume in one process
    row("reshard", 2, "expert-bias", model=DEEPSEEK_MOE, ep=2, tags=("save",)),
    row("reshard", 1, "expert-bias", model=DEEPSEEK_MOE),
]

# -- DeepSeek-V2 routing (converted DeepseekV2ForCausalLM checkpoints): softmax over all
# experts, not renormalized (--moe-router-pre-softmax), 8 experts in 4 groups, top-3 of 2
# groups (a group scored by its best expert), scaled, a shared expert, the first layer
# dense, multi-latent attention; trained by the moe-training suite
DEEPSEEK_V2_MOE = {"num_experts": 8, "moe_router_topk": 3, "moe_router_pre_softmax": True,
                   "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                   "moe_router_topk_scaling_factor": 2.5,
                   "moe_shared_expert_intermediate_size": 32, "moe_layer_freq": "[0]+[1]",
                   **MLA}
_DEEPSEEK += [
    row("moe-training", 2, "deepseek-v2", model=DEEPSEEK_V2_MOE, ep=2),
    row("moe-training", 4, "deepseek-v2", model=DEEPSEEK_V2_MOE, tp=2, sp=True, ep=2,
        etp=1),
]

# -- optim: each layout x (plain | distributed optimizer | sharded gradients) x (overlap off
# | on), and optimizer CPU offload (half of the elements, or all) on some layouts ----------
OPTIM_VARIANTS = {
    "": {},
    "ogr": {"overlap_grad": True},
    "distopt": {"distopt": True},
    "distopt-ogr-opg": {"distopt": True, "overlap_grad": True, "overlap_param": True},
    "optim_grads": {"strategy": "optim_grads"},
}
# (variant, short flags, optim overrides): on the layouts of OPTIM_EXTRA_LAYOUTS only
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
OPTIM_EXTRA = {
    "optim_grads-ogr-opg": ({"strategy": "optim_grads", "overlap_grad": True,
                             "overlap_param": True}, {}),
    "offload0.5": ({"strategy": "optim"}, OFFLOAD),
    "offload1": ({"strategy": "optim_grads"}, {**OFFLOAD, "optimizer_offload_fraction": 1.0}),
}
_OPTIM_LAYOUTS = [
    (2, {}, None), (4, {}, None), (4, {"tp": 2, "sp": True}, None), (4, {"pp": 2}, None),
    (4, {"pp": 2, "vpp": 2}, {"num_layers": 4}),   # its own reference (4 layers)
    (8, {"tp": 2}, None), (8, {"tp": 2, "pp": 2}, None), (8, {"pp": 2}, None),
]
OPTIM_EXTRA_LAYOUTS = [(2, {}, None), (4, {"tp": 2, "sp": True}, None),
                       (4, {"pp": 2, "vpp": 2}, {"num_layers": 4})]
# ZeRO-3 (parameters sharded too, gathered per layer): dp 2, tp 2 + sp and pp 2 x vpp 2 in
# the default run; dp 4, pp 2, tp 2 x pp 2, both overlaps and offload in the slow one
ZERO3 = {"strategy": "optim_grads_params"}
_SLOW = ("slow",)
_OPTIM_ZERO3 = [
    row("optim", 2, **ZERO3), row("optim", 4, tp=2, sp=True, **ZERO3),
    row("optim", 4, model={"num_layers": 4}, pp=2, vpp=2, **ZERO3),
    row("optim", 4, tags=_SLOW, **ZERO3), row("optim", 4, tags=_SLOW, pp=2, **ZERO3),
    row("optim", 8, tags=_SLOW, tp=2, pp=2, **ZERO3),
    row("optim", 2, tags=_SLOW, overlap_grad=True, overlap_param=True, **ZERO3),
    row("optim", 4, "offload1", optim={**OFFLOAD, "optimizer_offload_fraction": 1.0},
        tags=_SLOW, tp=2, sp=True, **ZERO3),
]
# multi-latent attention: pp 2 x vpp 2 with the distributed optimizer over dp 2, and
# ZeRO-3 over dp 2 with tp 2 + sp
_OPTIM_MLA = [
    row("optim", 4, "mla", model={**MLA, "num_layers": 4}, pp=2, vpp=2, distopt=True),
    row("optim", 4, "mla", model=MLA, tp=2, sp=True, **ZERO3),
]
# multi-token prediction: the depths' eh_proj over tp 2 + sp, on the last stage of pp 2
# (tied: the output layer and the depths share the stage's copy of the word embedding;
# untied: the copy is the depths' alone) and of pp 2 x vpp 2 with the distributed
# optimizer, with MLA under ZeRO-3, and under full recomputation
_OPTIM_MTP = [
    row("optim", 4, "mtp", model=MTP, tp=2, sp=True),
    row("optim", 4, "mtp", model=MTP, pp=2),
    row("optim", 4, "mtp-untied", model={**MTP, "untie_embeddings_and_output_weights": True},
        pp=2),
    row("optim", 4, "mtp", model={**MTP, "num_layers": 4}, pp=2, vpp=2, distopt=True),
    row("optim", 4, "mtp-mla", model={**MLA, **MTP}, tp=2, sp=True, **ZERO3),
    row("optim", 2, "mtp-full", model={**MTP, **RECOMPUTE["full-uniform"]}, distopt=True),
    # V schedules: the depths on pipeline rank 0's chunk 1, beside chunk 0's embedding
    # (tied: the output layer shares the depths' copy; untied: the copy is theirs alone)
    row("optim", 2, "mtp", model=MTP4, pp=2, schedule="zbv"),
    row("optim", 2, "mtp-untied", model={**MTP4, "untie_embeddings_and_output_weights": True},
        pp=2, schedule="zbv", distopt=True),
    row("optim", 2, "mtp", model=MTP4, pp=2, schedule="dualpipev"),
    row("optim", 2, "mtp", model=MTP4, pp=2, schedule="zbv", **ZERO3),
]
_OPTIM = [*(row("optim", world, model=model, **sizes, **flags)
            for world, sizes, model in _OPTIM_LAYOUTS for flags in OPTIM_VARIANTS.values()),
          *(row("optim", world, variant if "offload" in variant else "", model=model,
                optim=optim, **sizes, **flags)
            for world, sizes, model in OPTIM_EXTRA_LAYOUTS
            for variant, (flags, optim) in OPTIM_EXTRA.items()),
          *_OPTIM_ZERO3, *_OPTIM_MLA, *_OPTIM_MTP]

# -- muon: a Llama-style GQA model (Q, K, V orthogonalised apart; SwiGLU's fused fc1 one
# matrix), Muon's update against one process; --muon-tp-mode blockwise depends on tp and
# has no rows ---------------------------------------------------------------------------
MUON_MODEL = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
              "add_bias_linear": False, "group_query_attention": True, "num_query_groups": 2}
MUON_MOE = {**MUON_MODEL, "num_experts": 4}
MUON = {"optimizer": "muon", "muon_nesterov": True}
MUON_DIST = {**MUON, "muon_tp_mode": "distributed"}
_MUON = [
    row("muon", 2, model=MUON_MODEL, optim=MUON, tp=2, sp=True),
    row("muon", 2, "distributed", model=MUON_MODEL, optim=MUON_DIST, tp=2, sp=True),
    row("muon", 2, model={**MUON_MODEL, "num_layers": 4}, optim=MUON, pp=2, vpp=2),
    row("muon", 4, model=MUON_MODEL, optim=MUON),
    *(row("muon", 4, model=MUON_MODEL, optim=MUON, strategy=strategy)
      for strategy in ("optim", "optim_grads", "optim_grads_params")),
    row("muon", 4, model=MUON_MODEL, optim=MUON, tp=2, sp=True, strategy="optim"),
    row("muon", 4, "distributed", model=MUON_MODEL, optim=MUON_DIST, tp=2, sp=True,
        strategy="optim_grads"),
    # experts: owners over edp 2 (dense over dp 4), and experts split over etp 2
    row("muon", 4, model=MUON_MOE, optim=MUON, ep=2, strategy="optim"),
    row("muon", 4, model=MUON_MOE, optim=MUON_DIST, tp=2, sp=True, ep=2, etp=2),
    row("muon", 2, "offload0.5", model=MUON_MODEL, optim={**MUON, **OFFLOAD},
        strategy="optim_grads"),
]

# -- lion: --optimizer lion (element-wise, one state tensor) and Muon with the Lion scalar
# optimizer, on the Muon model, against one process --------------------------------------
LION = {"optimizer": "lion", "lr": 1e-3}
MUON_LION = {**MUON, "muon_scalar_optimizer": "lion"}
_LION = [
    row("lion", 2, model=MUON_MODEL, optim=LION, tp=2, sp=True),
    row("lion", 4, model={**MUON_MODEL, "num_layers": 4}, optim=LION, pp=2, vpp=2,
        distopt=True, overlap_grad=True, overlap_param=True),
    row("lion", 4, model=MUON_MODEL, optim=LION, strategy="optim_grads_params"),
    row("lion", 4, model=MUON_MOE, optim={**LION, **OFFLOAD}, ep=2, strategy="optim"),
    row("lion", 4, "muon", model=MUON_MODEL, optim=MUON_LION, tp=2, sp=True,
        strategy="optim"),
]

# -- pipeline: an 8-layer GPT, micro-batch 1, global batch 8 ------------------------------
_PIPE_MODEL, _PIPE_TRAIN = {"num_layers": 8}, {"micro_batch_size": 1, "global_batch_size": 8}
_PIPELINE = [row("pipeline", world, model=_PIPE_MODEL, train=_PIPE_TRAIN, **sizes)
             for world, sizes in (
                 (2, {"pp": 2}), (2, {"pp": 2, "vpp": 2}), (2, {"pp": 2, "first": 3}),
                 (4, {"pp": 4}), (4, {"pp": 4, "vpp": 2}), (4, {"pp": 2, "tp": 2}),
                 (4, {"pp": 2, "tp": 2, "sp": True, "vpp": 2}), (4, {"pp": 2, "vpp": 2}),
                 (8, {"pp": 2, "tp": 2, "sp": True, "vpp": 2}), (8, {"pp": 4, "tp": 2}),
                 (8, {"pp": 4, "vpp": 2}), (8, {"pp": 2, "tp": 2, "vpp": 4}))]
# zero bubble (split backward: B, then the deferred weight gradients in W)
_ZB = {"schedule": "zb_h1"}
_PIPELINE += [row("pipeline", world, model=_PIPE_MODEL, train=_PIPE_TRAIN, **sizes, **_ZB)
              for world, sizes in (
                  (2, {"pp": 2}), (4, {"pp": 4}), (4, {"pp": 2, "tp": 2, "sp": True}),
                  (4, {"pp": 2, "distopt": True, "overlap_grad": True}),
                  (4, {"pp": 2, **ZERO3}))]
_PIPELINE += [row("pipeline", 2, "recompute", model={**_PIPE_MODEL, **RECOMPUTE["full-uniform"]},
                  train=_PIPE_TRAIN, pp=2, **_ZB)]
# ZB-V: two chunks per rank in a V (the embedding and the tied output layer on rank 0)
_ZBV = {"schedule": "zbv"}
_PIPELINE += [row("pipeline", world, model=_PIPE_MODEL, train=_PIPE_TRAIN, **sizes, **_ZBV)
              for world, sizes in (
                  (2, {"pp": 2}), (4, {"pp": 4}), (4, {"pp": 2, "tp": 2, "sp": True}),
                  (4, {"pp": 2, "distopt": True, "overlap_grad": True}),
                  (4, {"pp": 2, **ZERO3}))]
# DualPipeV: the same V, DeepSeek's phases (8 micro-batches: m >= 2p at pp 4)
_PIPELINE += [row("pipeline", world, model=_PIPE_MODEL, train=_PIPE_TRAIN, **sizes,
                  schedule="dualpipev")
              for world, sizes in ((2, {"pp": 2}), (4, {"pp": 4}),
                                   (4, {"pp": 2, "tp": 2, "sp": True}))]
# full recomputation of a whole chunk: the W steps keep the parameters' accumulation nodes
_PIPELINE += [row("pipeline", 2, "recompute", model={**_PIPE_MODEL, **RECOMPUTE["full-uniform"]},
                  train=_PIPE_TRAIN, pp=2, **_ZBV)]

# -- training: tp 2 (+ sp) x dp 2 against one process -------------------------------------
_TRAINING = [row("training", 4, tp=2, sp=True)]

# -- grad-stats: the parameter norm and the zero-gradient count of the log line ----------
_GRAD_STATS = [row("grad-stats", 2, distopt=True),
               row("grad-stats", 2, distopt=True, overlap_grad=True, overlap_param=True),
               row("grad-stats", 2, strategy="optim_grads_params"),
               row("grad-stats", 2, tp=2, sp=True),
               row("grad-stats", 2, pp=2),
               row("grad-stats", 2, model={"num_experts": 4, "moe_router_topk": 2}, ep=2),
               row("grad-stats", 4, tp=2, pp=2, distopt=True),
               # ZB-V: the word embedding and its tied copy both on pipeline rank 0
               row("grad-stats", 2, model={"num_layers": 4}, pp=2, schedule="zbv"),
               # ZB-V with prediction depths: their copy of the word embedding counts once
               row("grad-stats", 2, "mtp", model=MTP4, pp=2, schedule="zbv")]

# -- resume: save and resume at the same layout, with dropout (bitwise the same losses) ---
_RESUME = [row("resume", 4, tp=2),                                  # test_resume_and_layouts
           row("resume", 2, model={"num_layers": 4},                # test_pipeline_training
               train={"micro_batch_size": 1, "global_batch_size": 4}, pp=2, vpp=2)]

# -- reshard: save at tp2 x pp2 x dp2, resume at tp1 (one process) and tp4 x dp2 ----------
_RESHARD = [row("reshard", 8, tp=2, pp=2, distopt=True, tags=("save",)),
            row("reshard", 1), row("reshard", 8, tp=4, distopt=True),
            # Muon (momentum of the matrices, Adam's moments of the rest): save at tp2 + sp x
            # dp2 x ep2 (owner exchange), resume there (bitwise), at one process, and at pp2
            # x dp2 x ep2 under ZeRO-3 (tests/checkpoint/test_optimizer_reshard.py)
            row("reshard", 4, "muon", model=MUON_MOE, optim=MUON, tp=2, sp=True, ep=2,
                strategy="optim", tags=("save",)),
            row("reshard", 1, "muon", model=MUON_MOE, optim=MUON),
            row("reshard", 4, "muon", model=MUON_MOE, optim=MUON, pp=2, ep=2,
                strategy="optim_grads_params"),
            # Lion (exp_avg of the linear weights, AdamW's moments for the rest): saved
            # under ZeRO-3 at dp 2, resumed there (bitwise), in one process and at tp 2 + sp
            # (tests/checkpoint/test_optimizer_reshard.py)
            row("reshard", 2, "lion", model=MUON_MODEL, optim=LION,
                strategy="optim_grads_params", tags=("save",)),
            row("reshard", 1, "lion", model=MUON_MODEL, optim=LION),
            row("reshard", 2, "lion", model=MUON_MODEL, optim=LION, tp=2, sp=True),
            # multi-latent attention: saved at tp 2 + sp (up projections split, down
            # projections whole), resumed in one process
            row("reshard", 2, "mla", model=MLA, tags=("save",), tp=2, sp=True),
            row("reshard", 1, "mla", model=MLA),
            # ZB-V's V placement (rank 0 holds layers 0 and 3) saved, resumed in one
            # process and at pp 2 under 1F1B (rank 0 holds layers 0 and 1)
            row("reshard", 2, model={"num_layers": 4}, pp=2, schedule="zbv", tags=("save",)),
            row("reshard", 1, "from-zbv", model={"num_layers": 4}),
            row("reshard", 2, "from-zbv", model={"num_layers": 4}, pp=2),
            # multi-token prediction saved at pp 2 (the depths and the last stage's copy of
            # the word embedding, untied output), resumed in one process
            row("reshard", 2, "mtp", model={**MTP, "untie_embeddings_and_output_weights": True},
                tags=("save",), pp=2),
            row("reshard", 1, "mtp", model={**MTP, "untie_embeddings_and_output_weights": True}),
            # multi-token prediction under ZB-V (the depths and their copy of the word
            # embedding on rank 0's chunk 1; the copy not saved) resumed in one process and
            # at pp 2 under 1F1B, and saved under 1F1B, resumed under ZB-V
            row("reshard", 2, "mtp", model=MTP4, pp=2, schedule="zbv", tags=("save",)),
            row("reshard", 2, "mtp4", model=MTP4, pp=2, tags=("save",)),
            row("reshard", 1, "mtp4", model=MTP4)]

# -- cp: context parallelism, each comm type, trained against one process -----------------
# a Llama-style GQA model (4 heads, 2 query groups: a2a at cp 2 splits both) at seq 32
CP_MODEL = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
            "add_bias_linear": False, "group_query_attention": True, "num_query_groups": 2,
            "seq_length": 32}
CP_MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}


CP_DOCUMENTS = {"reset_attention_mask": True, "reset_position_ids": True,
                "eod_mask_loss": True}


def _cp_row(world: int, comm: str, model: dict | None = None, train: dict | None = None,
            variant: str = "", **short: Any) -> Layout:
    return row("cp", world, "-".join(p for p in (comm, variant) if p),
               model={**CP_MODEL, "cp_comm_type": comm, **(model or {})}, train=train,
               **short)


_CP = [
    *(_cp_row(2, comm, cp=2) for comm in ("p2p", "allgather", "a2a")),
    _cp_row(4, "p2p", cp=4),
    _cp_row(4, "p2p", tp=2, sp=True, cp=2),
    _cp_row(4, "allgather", pp=2, cp=2),
    _cp_row(4, "a2a", model={"num_layers": 4}, pp=2, vpp=2, cp=2),
    _cp_row(4, "p2p", model={"num_layers": 4}, pp=2, cp=2, schedule="zbv"),
    _cp_row(4, "p2p", cp=2, distopt=True),
    # gradients and optimizer state sharded over dp x cp (4 ranks), half of it offloaded
    dataclasses.replace(_cp_row(4, "p2p", variant="offload0.5", cp=2, strategy="optim_grads",
                                overlap_grad=True), optim=OFFLOAD),
    _cp_row(4, "allgather", model=CP_MOE, cp=2, ep=2),
    _cp_row(4, "p2p", model={**DEEPSEEK_MOE, "num_layers": 2}, variant="deepseek", cp=2, ep=2),
    # ZeRO-3: parameters sharded and gathered per layer over dp x cp (4 ranks)
    _cp_row(4, "p2p", cp=2, strategy="optim_grads_params"),
    # recomputation replays the ring's and the all-to-all's forward inside checkpoints
    _cp_row(2, "p2p", model=RECOMPUTE["selective"], variant="selective", cp=2),
    _cp_row(2, "a2a", model=RECOMPUTE["full-uniform"], variant="full", cp=2),
    # document masks: also trained on data with many documents (test_documents.py)
    dataclasses.replace(_cp_row(2, "p2p", variant="docs", cp=2), data=CP_DOCUMENTS),
    # multi-latent attention: values narrower than keys through every exchange, with tp 2 +
    # sp, and its up projections recomputed with the kernel
    *(_cp_row(2, comm, model=MLA, variant="mla", cp=2) for comm in ("p2p", "allgather",
                                                                      "a2a")),
    _cp_row(4, "p2p", model=MLA, variant="mla", tp=2, sp=True, cp=2),
    _cp_row(2, "a2a", model={**MLA, **MLA_RECOMPUTE}, variant="mla-selective", cp=2),
    # multi-token prediction: the tokens and labels rolled on the whole sequence, then cut
    *(_cp_row(2, comm, model=MTP, variant="mtp", cp=2) for comm in ("p2p", "allgather",
                                                                      "a2a")),
    _cp_row(2, "p2p", model={**MLA, **MTP}, variant="mla-mtp", cp=2),
    _cp_row(4, "p2p", model=MTP, variant="mtp", tp=2, sp=True, cp=2),
]

# -- activation-offload: --cpu-offloading against the same layout without it (bitwise) ---
ACT_OFFLOAD = {"cpu_offloading": True, "cpu_offloading_num_layers": 1}
_ACT_OFFLOAD = [
    row("activation-offload", 1, model=ACT_OFFLOAD),
    # 4 micro-batches in flight through 2 chunks per stage, each with its own host copies
    row("activation-offload", 2, model={**ACT_OFFLOAD, "num_layers": 4}, pp=2, vpp=2),
    row("activation-offload", 4, model=ACT_OFFLOAD, tags=("slow",), tp=2, sp=True),
    row("activation-offload", 2, "selective", model={**ACT_OFFLOAD, **RECOMPUTE["selective"]},
        tags=("slow",)),
    # the recomputed first layer keeps nothing to offload; the second is offloaded
    row("activation-offload", 2, "full-block-bf16",
        model={**ACT_OFFLOAD, **RECOMPUTE["full-block"], "bf16": True}, tags=("slow",)),
    row("activation-offload", 2, "1f1b", model={**ACT_OFFLOAD, "num_layers": 4},
        tags=("slow",), pp=2, distopt=True),
    # parameters gathered per layer (ZeRO-3): the gathered weights are not copied
    row("activation-offload", 2, model=ACT_OFFLOAD, tags=("slow",),
        strategy="optim_grads_params"),
]

# -- fp8: each recipe's fp8 GEMMs trained against the one-process fp8 run ----------------
# sizes each recipe tiles: 16 (per-tensor scales) at hidden 32; 32-element blocks at
# hidden 64; 128-element blocks at hidden 128, seq 64 (blockwise: no tp, whose qkv shard
# 192 would cut a block); cp rows at seq 32 / micro-batch 4 (16 tokens per chunk)
FP8_MODEL = {
    "tensorwise": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"},
    "delayed": {"fp8_format": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 2,
                "fp8_amax_compute_algo": "max"},
    "mxfp8": {"fp8_format": "e4m3", "fp8_recipe": "mxfp8", "hidden_size": 64},
    "blockwise": {"fp8_format": "hybrid", "fp8_recipe": "blockwise", "hidden_size": 128,
                  "seq_length": 64},
}
_FP8_CP = ({"seq_length": 32}, {"micro_batch_size": 4})
FP8_GATHER = {"fp8_param_gather": True}
_FP8_MOE = {"num_experts": 4, "moe_router_topk": 2}
_FP8 = [
    *(row("fp8", 2, recipe, model=FP8_MODEL[recipe], **sizes)
      for recipe in ("tensorwise", "delayed", "mxfp8")
      for sizes in ({"tp": 2, "sp": True}, {"pp": 2}, {})),
    *(row("fp8", 2, recipe, model={**FP8_MODEL[recipe], **_FP8_CP[0]}, train=_FP8_CP[1], cp=2)
      for recipe in ("tensorwise", "delayed", "mxfp8")),
    # the routed experts' fp8 GEMMs (per-row scales): ep2, etp2 under tp2 + sp (a row's
    # amax over the split contraction), dp2 x ep2 (an expert multiplies two data-parallel
    # ranks' micro-batches at once), block recipes
    row("fp8", 2, "tensorwise", model={**FP8_MODEL["tensorwise"], **_FP8_MOE}, ep=2),
    row("fp8", 2, "tensorwise-moe", model={**FP8_MODEL["tensorwise"], **_FP8_MOE}, tp=2,
        sp=True),
    row("fp8", 4, "delayed-moe", model={**FP8_MODEL["delayed"], **_FP8_MOE}, ep=2),
    row("fp8", 2, "mxfp8-moe", model={**FP8_MODEL["mxfp8"], **_FP8_MOE}, tp=2, sp=True),
    row("fp8", 2, "blockwise-moe", model={**FP8_MODEL["blockwise"], **_FP8_MOE}, ep=2),
    row("fp8", 2, "blockwise", model=FP8_MODEL["blockwise"]),
    row("fp8", 4, "delayed", model=FP8_MODEL["delayed"], tp=2, sp=True, pp=2),
    # --fp8-param-gather: the fp8 linears' weights all-gathered as fp8 bytes quantised by
    # their shard owners with the whole weight's scale (amax MAX over dp and tp), under the
    # distributed optimizer and ZeRO-3's per-layer gathers
    *(row("fp8", 2, f"{recipe}-param-gather", model={**FP8_MODEL[recipe], **FP8_GATHER},
          **sizes)
      for recipe in ("tensorwise", "delayed")
      for sizes in ({"distopt": True}, {"strategy": "optim_grads_params"})),
    row("fp8", 4, "tensorwise-param-gather",
        model={**FP8_MODEL["tensorwise"], **FP8_GATHER}, tp=2, sp=True, distopt=True),
    # a bucket per parameter: every fp8 weight is cut between the two ranks' shards, so
    # each owner needs the other's amax (tests/fp8/test_param_gather.py plants its loss)
    row("fp8", 2, "tensorwise-param-gather-small-buckets",
        model={**FP8_MODEL["tensorwise"], **FP8_GATHER}, distopt=True, bucket=1),
    # ZeRO-3 without the fp8 gather: a freed unit forgets its fp8 copies (a linear's, the
    # block recipes' two layouts, the routed experts'), made again after the next gather
    *(row("fp8", 2, recipe, model=FP8_MODEL[recipe], strategy="optim_grads_params")
      for recipe in ("tensorwise", "mxfp8")),
    row("fp8", 2, "tensorwise-moe", model={**FP8_MODEL["tensorwise"], **_FP8_MOE},
        strategy="optim_grads_params"),
]

# -- qk-clip: --qk-clip (Kimi-K2's MuonClip) at a threshold the tiny models' logits pass
# from the first step, so every step clips some heads; the max over micro-batches (4 per
# step at dp 1), dp and cp ranks, and the clip on the distributed optimizer's pieces of the
# masters, against one process. A Qwen-style GQA model (a QKV bias, scaled with its rows)
QK_CLIP = {"qk_clip": True, "qk_clip_threshold": 0.04, "qk_clip_alpha": 0.3}
QK_CLIP_MODEL = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
                 "add_bias_linear": False, "add_qkv_bias": True,
                 "group_query_attention": True, "num_query_groups": 2, **QK_CLIP}
QK_CLIP_MLA = {**MLA, **QK_CLIP, "qk_clip_threshold": 0.02}
_QK_CLIP = [
    row("qk-clip", 2, model=QK_CLIP_MODEL, tp=2, sp=True),
    row("qk-clip", 2, model=QK_CLIP_MODEL, cp=2),
    row("qk-clip", 2, "a2a", model={**QK_CLIP_MODEL, "cp_comm_type": "a2a"}, cp=2),
    row("qk-clip", 2, model=QK_CLIP_MODEL, pp=2),
    row("qk-clip", 2, model=QK_CLIP_MODEL, distopt=True),
    row("qk-clip", 2, "muon", model=QK_CLIP_MODEL, optim=MUON, distopt=True),
    row("qk-clip", 2, "muon", model=QK_CLIP_MODEL, optim=MUON, tp=2, sp=True),
    row("qk-clip", 4, model=QK_CLIP_MODEL, tp=2, sp=True, strategy="optim_grads_params"),
    row("qk-clip", 4, "muon", model=QK_CLIP_MODEL, optim=MUON, cp=2, distopt=True),
    row("qk-clip", 2, "mla", model=QK_CLIP_MLA, tp=2, sp=True),
    row("qk-clip", 2, "mla", model=QK_CLIP_MLA, cp=2),
    # the forward replayed by full recomputation observes again (the same maxima, and under
    # cp the same all-gather); bf16 with fp32 masters: the clip scales the masters
    row("qk-clip", 2, "full", model={**QK_CLIP_MODEL, **RECOMPUTE["full-uniform"]}, cp=2),
    row("qk-clip", 2, "bf16", model={**QK_CLIP_MODEL, "bf16": True}, distopt=True),
]

SUITES = ("model", "mixtral", "moe-layer", "moe-training", "optim", "muon", "lion",
          "pipeline", "training", "resume", "reshard", "cp", "activation-offload", "fp8",
          "grad-stats", "qk-clip")
LAYOUTS: tuple[Layout, ...] = (*_MODEL, *_MIXTRAL, *_MOE_LAYER, *_MOE_TRAINING, *_DEEPSEEK,
                               *_OPTIM, *_MUON, *_LION, *_PIPELINE, *_TRAINING, *_RESUME,
                               *_RESHARD, *_CP, *_ACT_OFFLOAD, *_FP8, *_GRAD_STATS, *_QK_CLIP)


def layouts(tag: str | None = None, world: int | None = None,
            where: Callable[[Layout], bool] | None = None) -> list[Layout]:
    """The rows carrying ``tag`` (all rows when None), of world size ``world`` if given."""
    return [r for r in LAYOUTS if (tag is None or tag in r.tags)
            and (world is None or r.world_size == world) and (where is None or where(r))]


def by_name(name: str) -> Layout:
    """The row called ``name``."""
    for r in LAYOUTS:
        if r.name == name:
            return r
    raise KeyError(f"no layout {name!r} in tests/layouts.py")
