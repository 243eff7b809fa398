"""Parallel layout: tensor, pipeline, context, expert and data parallel settings."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.fields import arg, check_choices, positive, require

# --data-parallel-sharding-strategy: what data parallelism shards, from nothing to everything
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# --pipeline-schedule, with torchtitan's names (Megatron-LM has no such flag: it runs 1F1B,
# interleaved when there are virtual stages); the step lists are megalite.pipeline's
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zbv", "dualpipev")   # need vpp > 1
# two chunks per rank in a V (the first and the last layers on pipeline rank 0)
V_SCHEDULES = ("zbv", "dualpipev")
NOT_IMPLEMENTED_SCHEDULES: tuple[str, ...] = ()


def is_v_schedule(schedule: str | None) -> bool:
    """Whether ``schedule`` places two chunks per rank in a V (``megalite.pipeline.plan``)."""
    return schedule in V_SCHEDULES


def default_pipeline_schedule(vpp: int | None) -> str:
    """The schedule without ``--pipeline-schedule``: Megatron-LM's choice by ``vpp``."""
    return "interleaved_1f1b" if (vpp or 1) > 1 else "1f1b"


def check_pipeline_schedule(schedule: str | None, vpp: int | None) -> str:
    """``schedule`` (None: the default) resolved for ``vpp`` model chunks per pipeline
    rank; one ConfigError line when the two do not fit."""
    schedule = schedule or default_pipeline_schedule(vpp)
    multi = (vpp or 1) > 1
    require(schedule not in NOT_IMPLEMENTED_SCHEDULES,
            f"--pipeline-schedule {schedule} is not implemented")
    if schedule in V_SCHEDULES:
        require(vpp in (None, 2),
                f"--pipeline-schedule {schedule} places exactly two model chunks per "
                f"pipeline rank (a V), not {vpp}: drop --virtual-pipeline-model-parallel-size"
                " (it is then 2) or give 2 (--num-layers-per-virtual-pipeline-stage = "
                "num_layers / (2 x pipeline size))")
    elif schedule in MULTI_CHUNK_SCHEDULES:
        require(multi, f"--pipeline-schedule {schedule} runs several model chunks per "
                       "pipeline rank: give --virtual-pipeline-model-parallel-size > 1 (or "
                       "--num-layers-per-virtual-pipeline-stage), or use 1f1b / zb_h1")
    else:
        require(not multi, f"--pipeline-schedule {schedule} runs one model chunk per "
                           f"pipeline rank, not {vpp}: drop "
                           "--virtual-pipeline-model-parallel-size / "
                           "--num-layers-per-virtual-pipeline-stage, or use "
                           "interleaved_1f1b")
    return schedule


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> int:
    """``world / (tp x pp x cp)``: what is left of the world for data parallelism."""
    mp = tp * pp * cp
    require(world_size % mp == 0,
            f"world size ({world_size}) must be divisible by tensor_model_parallel_size "
            f"({tp}) x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) "
            f"= {mp}")
    return world_size // mp


def expert_data_parallel_size(tp: int, cp: int, dp: int, ep: int, etp: int) -> int:
    """``tp x cp x dp / (ep x etp)``: the data-parallel size of the experts, whose ranks
    regroup the dense ranks of a pipeline stage as etp x ep x edp."""
    dense = tp * cp * dp
    require(dense % (ep * etp) == 0,
            f"expert_model_parallel_size ({ep}) x expert_tensor_parallel_size ({etp}) must "
            f"divide tp x cp x dp ({dense})")
    return dense // (ep * etp)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = arg(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = arg(1, "Pipeline model parallel size.")
    virtual_pipeline_model_parallel_size: int | None = arg(
        None, "Model chunks per pipeline rank (interleaved 1F1B).")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "Layers per virtual pipeline stage (sets the virtual size).")
    pipeline_schedule: str | None = arg(
        None, "Pipeline schedule: 1f1b, interleaved_1f1b (needs virtual pipeline stages), "
        "zb_h1 (zero bubble H1: each backward split into the input-gradient part, which "
        "the previous stage waits for, and the weight-gradient GEMMs, run later to fill the "
        "bubble; 1F1B's activation memory, about a third of its bubble), zbv (ZB-V: two "
        "chunks per rank in a V, the first and last layers on rank 0, the same split "
        "backward; 1F1B's activation memory, a sixth of its bubble; virtual size 2, derived "
        "when not given), dualpipev (DeepSeek-V3's DualPipeV on the same V: each forward "
        "paired with the other chunk's backward; needs 2 x pipeline size micro-batches). "
        "Unset: "
        "interleaved_1f1b with virtual pipeline stages, else 1f1b.",
        choices=PIPELINE_SCHEDULES)
    decoder_first_pipeline_num_layers: int | None = arg(None, "Layers on the first stage.")
    decoder_last_pipeline_num_layers: int | None = arg(None, "Layers on the last stage.")
    sequence_parallel: bool = arg(False, "Shard norms/dropout activations along the sequence "
                                  "over the tensor parallel group.")
    context_parallel_size: int = arg(1, "Context parallel size.")
    expert_model_parallel_size: int = arg(1, "Expert model parallel size.")
    expert_tensor_parallel_size: int | None = arg(None, "Tensor parallel size of the "
                                                     "experts (default: tp).")
    use_distributed_optimizer: bool = arg(False, "Shard optimizer state over data parallel "
                                          "(the same as --data-parallel-sharding-strategy "
                                          "optim).")
    data_parallel_sharding_strategy: str | None = arg(
        None, "What data parallelism shards: nothing (no_shard), the fp32 main "
        "parameters and optimizer state (optim, ZeRO-1: --use-distributed-optimizer), also "
        "the reduced gradients (optim_grads, ZeRO-2: each rank keeps only its shard of the "
        "gradients between steps), also the parameters (optim_grads_params, ZeRO-3: each "
        "layer's parameters are all-gathered before its forward and its backward and freed "
        "after, the next layer's gather prefetched). Unset: optim with "
        "--use-distributed-optimizer, else no_shard.",
        choices=SHARDING_STRATEGIES)
    use_torch_fsdp2: bool = arg(False, "Wrap the model in torch FSDP2 (refused: it does not "
                                "compose with megalite's gradient buffers; use "
                                "--data-parallel-sharding-strategy optim_grads_params).")
    overlap_moe_expert_parallel_comm: bool = arg(
        False, "Overlap the MoE token dispatch / combine all-to-alls of one micro-batch "
        "with the computation of another: each backward runs paired with the next forward, "
        "the two taking turns at every expert all-to-all (which runs while the other "
        "computes); in a pipeline every steady-state backward pairs, on every stage. Needs "
        "expert parallelism, the alltoall dispatcher, 1f1b or interleaved_1f1b and >= 2 "
        "micro-batches per step.")
    delay_wgrad_compute: bool = arg(
        False, "With --overlap-moe-expert-parallel-comm: the paired backward computes input "
        "gradients only; its weight-gradient GEMMs run after the pair.")
    overlap_grad_reduce: bool = arg(False, "Overlap gradient reduction with backward.")
    overlap_param_gather: bool = arg(False, "Overlap the parameter all-gather with forward.")
    ddp_bucket_size: int | None = arg(None, "Gradient bucket size in elements.")
    grad_reduce_in_bf16: bool = arg(False, "Reduce gradients in bfloat16.")
    distributed_backend: str = arg("auto", "Process group backend (auto: nccl on GPU, "
                                   "gloo otherwise).", choices=("auto", "nccl", "gloo"))
    device: str = arg("auto", "Where each rank computes: cuda:LOCAL_RANK (cuda), the CPU "
                      "(cpu), or cuda when a GPU is visible, else cpu (auto; the "
                      "MEGALITE_DEVICE environment variable can set it).",
                      choices=("auto", "cpu", "cuda"))
    distributed_timeout_minutes: float = arg(
        10.0, "Timeout of collectives in minutes (fractions allowed: 0.25 is 15 s); a "
        "collective that does not complete in time fails on every rank with one error "
        "naming the group, the operation and the ranks that never arrived (exit code 8).")
    log_straggler: bool = arg(False, "Every log interval, gather each rank's step time and "
                              "its forward-backward / optimizer / communication split and "
                              "name the slowest ranks (log and metrics JSONL).")
    straggler_minmax_count: int = arg(1, "How many slowest and fastest ranks "
                                      "--log-straggler names.")
    disable_straggler_on_startup: bool = arg(
        False, "Leave the first log interval (start-up) out of --log-straggler's reports "
        "(Megatron starts its detector disabled until toggled on a control port; megalite has "
        "no control port).")
    variable_seq_lengths: bool = arg(False, "Exchange shapes before pipeline transfers.")
    empty_unused_memory_level: int = arg(
        0, "Free unused device memory after each step (1) or also after the optimizer (2).",
        choices=(0, 1, 2),
        no_effect="it empties the CUDA caching allocator; on CPU the allocator returns memory "
                  "by itself")

    def __post_init__(self) -> None:
        check_choices(self)
        positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                  "context_parallel_size", "expert_model_parallel_size",
                  "expert_tensor_parallel_size", "distributed_timeout_minutes",
                  "straggler_minmax_count",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        if self.ddp_bucket_size is not None:
            require(self.ddp_bucket_size > 0,
                     f"--ddp-bucket-size must be > 0, got {self.ddp_bucket_size}")
        require(not self.use_torch_fsdp2, "--use-torch-fsdp2 is not supported: torch's "
                "fully_shard makes every parameter a DTensor, while megalite's gradient "
                "buffers, distributed optimizer, clipping and checkpoints work on plain tensors "
                "(building the buffers over a fully_shard-ed GPTModel fails with 'aten.copy_ "
                "got mixed torch.Tensor and DTensor'); use --data-parallel-sharding-strategy "
                "optim_grads_params, megalite's own ZeRO-3")
        if self.data_parallel_sharding_strategy is None:   # not given: the switch decides
            self.data_parallel_sharding_strategy = (
                "optim" if self.use_distributed_optimizer else "no_shard")
        require(not (self.use_distributed_optimizer
                     and self.data_parallel_sharding_strategy == "no_shard"),
                "--use-distributed-optimizer shards the optimizer state over data parallel "
                "ranks (--data-parallel-sharding-strategy optim), which contradicts "
                "--data-parallel-sharding-strategy no_shard; drop one of the two (or give "
                "optim, optim_grads or optim_grads_params)")
        # optim, optim_grads and optim_grads_params run the distributed optimizer
        self.use_distributed_optimizer = self.data_parallel_sharding_strategy != "no_shard"
        if self.overlap_param_gather:
            require(self.use_distributed_optimizer,
                     "--overlap-param-gather needs --use-distributed-optimizer")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # Megatron silently turns it off; so do we (it is a no-op at tp=1).
            self.sequence_parallel = False
        require(self.virtual_pipeline_model_parallel_size is None
                 or self.num_layers_per_virtual_pipeline_stage is None,
                 "give either --virtual-pipeline-model-parallel-size or "
                 "--num-layers-per-virtual-pipeline-stage, not both")
        vpp = (self.virtual_pipeline_model_parallel_size
               or self.num_layers_per_virtual_pipeline_stage)
        if vpp is not None:
            require(self.pipeline_model_parallel_size > 1,
                     "virtual pipeline stages need --pipeline-model-parallel-size > 1")

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        return data_parallel_size(world_size, self.tensor_model_parallel_size,
                                  self.pipeline_model_parallel_size, self.context_parallel_size)
