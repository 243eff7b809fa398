"""Batch-level overlap of the MoE all-to-alls (``--overlap-moe-expert-parallel-comm``,
``--delay-wgrad-compute``): what the flags may be combined with.

The fields are :class:`megalite.config.parallel.ParallelConfig`'s; the execution is
:mod:`megalite.parallel.paired_lanes` (two micro-batches taking turns at each expert
all-to-all) driven by :func:`megalite.pipeline.schedules.run_schedule`. Megatron-LM pairs
the forward of one micro-batch with the backward of another (its "combined 1F1B");
megalite does so wherever 1F1B (plain or interleaved) puts a backward right before the next
forward on the same rank: every pair at one pipeline stage (gradient accumulation), and in
a pipeline every backward of the steady state on every stage, the pipeline plan running
each pair as one unit that waits for both inputs and sends both outputs
(:func:`megalite.pipeline.plan.pairs_of`). At least two micro-batches per step.
"""

from __future__ import annotations

from megalite.config.fields import require

FLAG = "--overlap-moe-expert-parallel-comm"


def check_moe_overlap(m, p, t, dp: int) -> None:
    """The two flags against the model (``m``), the layout (``p``) and the batches (``t``
    TrainConfig, ``dp`` data-parallel size); one ConfigError line per problem."""
    if p.delay_wgrad_compute:
        require(p.overlap_moe_expert_parallel_comm,
                f"--delay-wgrad-compute defers the weight gradients of the backward that "
                f"{FLAG} pairs with the next forward; give {FLAG} too, or drop it")
    if not p.overlap_moe_expert_parallel_comm:
        return
    require(not m.moe_shared_expert_overlap,
            f"{FLAG} with --moe-shared-expert-overlap is not supported (as in Megatron-LM): "
            "the other micro-batch already hides the all-to-all; drop one of the two")
    require(bool(m.num_experts),
            f"{FLAG} overlaps the token dispatch of MoE layers: the model has none; give "
            "--num-experts or drop the flag")
    ep = p.expert_model_parallel_size
    require(ep > 1, f"{FLAG} overlaps the all-to-all over expert parallel ranks: at "
                    f"--expert-model-parallel-size {ep} there is none; give an expert "
                    "parallel size > 1 or drop the flag")
    require(m.moe_token_dispatcher_type in ("alltoall", "flex"),
            f"{FLAG} overlaps the alltoall dispatcher's exchanges, not "
            f"--moe-token-dispatcher-type {m.moe_token_dispatcher_type}; use alltoall")
    vpp = (p.virtual_pipeline_model_parallel_size
           or p.num_layers_per_virtual_pipeline_stage)
    schedule = p.pipeline_schedule or ("interleaved_1f1b" if (vpp or 1) > 1 else "1f1b")
    require(schedule in ("1f1b", "interleaved_1f1b"),
            f"{FLAG} pairs each backward with the next forward of 1F1B; --pipeline-schedule "
            f"{schedule} orders them otherwise (split backwards, a V); use 1f1b or "
            "interleaved_1f1b")
    require(m.recompute_granularity != "full",
            f"{FLAG} with --recompute-granularity full is not supported (the recomputed "
            "forward would replay random state while the other micro-batch runs); use "
            "selective recomputation without moe, or none")
    require(not m.recomputes("moe"),
            f"{FLAG} with --recompute-modules moe (or --moe-layer-recompute) is not "
            "supported: the recomputed all-to-all would run inside the other micro-batch's "
            "turn; drop moe from --recompute-modules")
    require(p.data_parallel_sharding_strategy != "optim_grads_params",
            f"{FLAG} with --data-parallel-sharding-strategy optim_grads_params is not "
            "supported: a layer's gathered parameters would be freed by one micro-batch "
            "while the other still uses them; use optim_grads or optim")
    require(not m.cpu_offloading,
            f"{FLAG} with --cpu-offloading is not supported: the offload's per-layer "
            "hand-over assumes one micro-batch at a time; drop one of the two")
    gbs, mbs = t.global_batch_size, t.micro_batch_size
    micro = gbs // (mbs * dp) if gbs else 1
    require(micro >= 2,
            f"{FLAG} pairs the backward of one micro-batch with the forward of the next: "
            f"global batch {gbs} / (micro batch {mbs} x data parallel {dp}) gives {micro} "
            "micro-batch per step; raise --global-batch-size to at least 2 micro-batches "
            "per data-parallel rank or drop the flag")
