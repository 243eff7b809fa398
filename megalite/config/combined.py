"""All sections together, and the checks that relate them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalite.config.batch_schedule import BatchSchedule, parse_step_schedule
from megalite.config.data import DataConfig
from megalite.config.fields import ConfigError, require
from megalite.config.layout import ResolvedLayout, resolve_layout
from megalite.config.model import ModelConfig
from megalite.config.moe_overlap import check_moe_overlap
from megalite.config.mtp import check_mtp_layout
from megalite.config.optim import OptimConfig
from megalite.config.parallel import (
    ParallelConfig,
    check_pipeline_schedule,
    is_v_schedule,
    expert_data_parallel_size,
)
from megalite.config.run import CheckpointConfig, LoggingConfig, TrainConfig

SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass
class MegaliteConfig:
    """All sections together; :meth:`validate` checks how they relate."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: int) -> MegaliteConfig:
        """Check the sections against each other for ``world_size`` processes.

        Fills derived values (global batch size default) and returns self.
        """
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor_model_parallel_size
        dp = p.data_parallel_size(world_size)
        if self.optim.optimizer_cpu_offload:
            require(p.data_parallel_sharding_strategy != "no_shard",
                    "--optimizer-cpu-offload with --data-parallel-sharding-strategy "
                    f"{p.data_parallel_sharding_strategy} is not supported yet; use optim, "
                    "optim_grads or optim_grads_params (or --use-distributed-optimizer)")
        require(not m.fp8_param_gather or p.use_distributed_optimizer,
                "--fp8-param-gather needs the distributed optimizer, whose parameter "
                "all-gather it makes fp8: add --use-distributed-optimizer (or "
                "--data-parallel-sharding-strategy optim, optim_grads or optim_grads_params), "
                "or drop --fp8-param-gather")
        o = self.optim
        if o.optimizer == "muon" and o.muon_tp_mode != "duplicated":
            etp = p.expert_tensor_parallel_size if m.num_experts else 1
            require(tp > 1 or etp > 1,
                    f"--muon-tp-mode {o.muon_tp_mode} does not apply at "
                    "--tensor-model-parallel-size 1"
                    + (" with --expert-tensor-parallel-size 1" if m.num_experts else "")
                    + ": every matrix is whole on its rank; drop --muon-tp-mode")
        require(not (p.data_parallel_sharding_strategy == "optim_grads_params"
                     and t.compile),
                "--data-parallel-sharding-strategy optim_grads_params with --compile is not "
                "supported yet: each compiled layer is traced with its parameters freed (a "
                "stride-0 placeholder) and its guards fail on the gathered ones; drop "
                "--compile or use optim_grads")
        if p.sequence_parallel:
            require(m.seq_length % (tp * p.context_parallel_size) == 0,
                     f"seq_length ({m.seq_length}) must be divisible by "
                     f"tensor_model_parallel_size ({tp}) x context_parallel_size "
                     f"({p.context_parallel_size}) under --sequence-parallel")
        if p.context_parallel_size > 1:
            require(m.seq_length % (2 * p.context_parallel_size) == 0,
                     f"seq_length ({m.seq_length}) must be divisible by 2 x "
                     f"context_parallel_size ({p.context_parallel_size})")
        self._validate_pipeline()
        check_mtp_layout(m, p)
        self._validate_experts(dp)
        self._validate_training_length()
        self._validate_batches(dp)
        check_moe_overlap(m, p, t, dp)
        m.check_fp8_tiling(tp, p.context_parallel_size, t.micro_batch_size,
                           p.expert_tensor_parallel_size)
        if self.checkpoint.save_interval is not None and self.checkpoint.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        if not self.data.mock_data and self.data.tokenizer_type == "NullTokenizer":
            require(m.vocab_size is not None, "NullTokenizer needs --vocab-size")
        return self

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Validate for ``world_size`` ranks (:meth:`validate`) and return the resolved
        :class:`~megalite.config.layout.ResolvedLayout`: every size and count derived once."""
        return resolve_layout(self.validate(world_size), world_size)

    def _validate_training_length(self) -> None:
        """Megatron's rule: iteration-based and sample-based lengths and LR schedules do
        not mix."""
        t, o = self.train, self.optim
        # here, not in TrainConfig: the built run's copy gets train_iters from train_samples
        # (training.build), and a checkpoint records that copy
        require(not (t.train_iters is not None and t.train_samples is not None),
                 "give either --train-iters or --train-samples, not both")
        if t.train_iters is not None:
            base = "--train-iters (iteration-based training)"
            for name in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"):
                require(not getattr(o, name), f"{base} excludes "
                        f"--{name.replace('_', '-')}; use the matching --...-iters flag")
        if t.train_samples is not None:
            base = "--train-samples (sample-based training)"
            for name in ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters"):
                require(not getattr(o, name), f"{base} excludes "
                        f"--{name.replace('_', '-')}; use the matching --...-samples flag")

    def _validate_batches(self, dp: int) -> None:
        """Resolve the global batch (the last of a schedule, or micro x dp by default) and
        check every batch size against micro_batch_size x dp, and for the interleaved
        schedule its micro-batches against pp (``BatchSchedule.check_divisible``)."""
        t, p = self.train, self.parallel
        if t.step_batch_size_schedule:
            final = parse_step_schedule(t.step_batch_size_schedule, self.model.seq_length)[-1][1]
            require(t.global_batch_size in (None, final),
                     f"--global-batch-size ({t.global_batch_size}) differs from the last batch "
                     f"size of --step-batch-size-schedule ({final}); drop one or make them "
                     "equal")
            t.global_batch_size = final
        elif t.rampup_batch_size:
            require(t.global_batch_size is not None,
                     "--rampup-batch-size needs --global-batch-size (the size it ramps up to)")
        elif t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        interleaved = check_pipeline_schedule(
            p.pipeline_schedule, p.virtual_pipeline_model_parallel_size) == "interleaved_1f1b"
        batches = BatchSchedule.from_config(t, self.model.seq_length)
        batches.check_divisible(
            t.micro_batch_size, dp, p.pipeline_model_parallel_size if interleaved else None)
        if p.pipeline_schedule == "dualpipev":
            fewest = min(batch for _, batch in batches.entries) // (t.micro_batch_size * dp)
            require(fewest >= 2 * p.pipeline_model_parallel_size,
                    f"--pipeline-schedule dualpipev needs at least 2 x "
                    f"pipeline_model_parallel_size ({2 * p.pipeline_model_parallel_size}) "
                    f"micro-batches per step, and a step here has {fewest} (global batch / "
                    "(micro batch x data parallel size)); raise --global-batch-size or lower "
                    "--micro-batch-size, or use zbv")

    def _validate_pipeline(self) -> None:
        m, p = self.model, self.parallel
        pp = p.pipeline_model_parallel_size
        first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if is_v_schedule(p.pipeline_schedule):
            self._validate_v_placement()
        if first is not None or last is not None:
            require(middle_layers >= 0 and (middle_stages > 0 or middle_layers == 0),
                     f"decoder first/last pipeline layers ({first}, {last}) do not fit "
                     f"num_layers ({m.num_layers}) over {pp} pipeline stages")
            if middle_stages > 0:
                require(middle_layers % middle_stages == 0,
                         f"the {middle_layers} layers left after the first/last stage "
                         f"must divide over the {middle_stages} middle stages")
                require(middle_layers >= middle_stages,
                        f"decoder first/last pipeline layers ({first}, {last}) leave "
                        f"{middle_layers} of num_layers ({m.num_layers}) for "
                        f"{middle_stages} middle stages: every pipeline stage needs at least "
                        "one layer")
        else:
            require(m.num_layers % pp == 0,
                     f"num_layers ({m.num_layers}) must be divisible by "
                     f"pipeline_model_parallel_size ({pp}) (or set "
                     "--decoder-first/last-pipeline-num-layers)")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_stage = m.num_layers // pp
            require(per_stage % p.num_layers_per_virtual_pipeline_stage == 0,
                     f"layers per pipeline stage ({per_stage}) must be divisible by "
                     f"num_layers_per_virtual_pipeline_stage "
                     f"({p.num_layers_per_virtual_pipeline_stage})")
            p.virtual_pipeline_model_parallel_size = (
                per_stage // p.num_layers_per_virtual_pipeline_stage)
        vpp = p.virtual_pipeline_model_parallel_size
        check_pipeline_schedule(p.pipeline_schedule, vpp)
        if vpp is not None and first is None and last is None:
            require(m.num_layers % (pp * vpp) == 0,
                     f"num_layers ({m.num_layers}) must be divisible by "
                     f"pipeline_model_parallel_size ({pp}) x virtual pipeline size ({vpp})")

    def _validate_v_placement(self) -> None:
        """zbv / dualpipev: two chunks per rank in a V (``megalite.pipeline.v_shape``); the
        virtual size is 2, derived when not given (as torchtitan fixes two stages per rank
        for its V schedules)."""
        m, p = self.model, self.parallel
        pp, name = p.pipeline_model_parallel_size, p.pipeline_schedule
        require(pp > 1, f"--pipeline-schedule {name} places two model chunks on each of "
                        "several pipeline ranks: give --pipeline-model-parallel-size > 1")
        require(p.decoder_first_pipeline_num_layers is None
                and p.decoder_last_pipeline_num_layers is None,
                f"--pipeline-schedule {name} puts the first and the last layers on pipeline "
                "rank 0, so --decoder-first/last-pipeline-num-layers cannot make the first "
                "or last stage uneven; drop them or use 1f1b / zb_h1 / interleaved_1f1b")
        require(m.num_layers % (2 * pp) == 0,
                f"--pipeline-schedule {name} splits each pipeline rank's layers into two "
                f"chunks of a V: num_layers ({m.num_layers}) must be divisible by 2 x "
                f"pipeline_model_parallel_size ({2 * pp})")
        if (p.virtual_pipeline_model_parallel_size is None
                and p.num_layers_per_virtual_pipeline_stage is None):
            p.virtual_pipeline_model_parallel_size = 2

    def _validate_experts(self, dp: int) -> None:
        m, p = self.model, self.parallel
        ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
        if ep > 1 or etp != p.tensor_model_parallel_size:
            require(m.num_experts is not None,
                     "--expert-model-parallel-size / --expert-tensor-parallel-size need "
                     "--num-experts")
        expert_data_parallel_size(p.tensor_model_parallel_size, p.context_parallel_size, dp,
                                  ep, etp)
        m.check_layout(p.tensor_model_parallel_size, p.context_parallel_size, ep, etp)
        require(not (m.num_experts is not None and m.moe_token_dispatcher_type == "allgather"
                      and p.variable_seq_lengths),
                 "--moe-token-dispatcher-type allgather assumes equal token counts on every "
                 "expert-parallel rank and cannot be used with --variable-seq-lengths; use "
                 "alltoall")

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> MegaliteConfig:
        """The config :meth:`to_dict` wrote; ``ConfigError`` naming every section or
        field this megalite does not have (a config written by another version)."""
        unknown = [name for name in d if name not in SECTIONS]
        for name, section in SECTIONS.items():
            fields = {f.name for f in dataclasses.fields(section)}
            unknown += [f"{name}.{k}" for k in d.get(name, {}) if k not in fields]
        require(not unknown, f"the saved config has settings this megalite does not know: "
                             f"{', '.join(unknown)} (written by another megalite version?)")
        return cls(**{name: SECTIONS[name](**d.get(name, {})) for name in SECTIONS})
