"""Optimizer, learning-rate schedule, loss scaling and clipping settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megalite.config.fields import ConfigError, arg, check_choices, positive, require

FP32_MAX = 3.4028234663852886e38   # the largest finite fp32 number (torch.finfo)


def _optimizers() -> tuple[str, ...]:
    """The values --optimizer accepts: the algorithms' registry (read when called)."""
    from megalite.optim.algorithms import ALGORITHMS

    return tuple(ALGORITHMS)


def _coefficient_types() -> tuple[str, ...]:
    from megalite.optim.newton_schulz import COEFFICIENT_TYPES

    return COEFFICIENT_TYPES


MUON_TP_MODES = ("duplicated", "distributed", "blockwise")


def uses_lion(optimizer: str | None, muon_scalar_optimizer: str | None) -> bool:
    """Whether a run with these --optimizer / --muon-scalar-optimizer values steps
    parameters with Lion (and so reads --lion-beta1/2)."""
    return optimizer == "lion" or (optimizer == "muon" and muon_scalar_optimizer == "lion")


@dataclass
class OptimConfig:
    optimizer: str = arg("adam", "Optimizer (adam is AdamW; muon orthogonalises the weight "
                         "matrices' momentum, --muon-scalar-optimizer for the rest; lion "
                         "steps by the sign of a momentum).", choices=_optimizers)
    lr: float = arg(1e-4, "Peak learning rate.")
    min_lr: float = arg(0.0, "Minimum learning rate.")
    lr_decay_style: str = arg("linear", "Learning-rate decay.",
                              choices=("constant", "linear", "cosine", "inverse-square-root",
                                       "WSD"))
    lr_decay_iters: int | None = arg(None, "Decay iterations (default train_iters).")
    lr_decay_samples: int | None = arg(None, "Decay samples (sample-based training; "
                                       "default train_samples).")
    lr_warmup_iters: int = arg(0, "Linear warm-up iterations.")
    lr_warmup_samples: int = arg(0, "Linear warm-up samples (sample-based training).")
    lr_warmup_fraction: float | None = arg(None, "Warm-up as a fraction of decay iters.")
    lr_warmup_init: float = arg(0.0, "Learning rate the linear warm-up starts from (it "
                                "rises from here to --lr).")
    lr_wsd_decay_style: str = arg("exponential", "Decay of the WSD cool-down.",
                                  choices=("exponential", "linear", "cosine"))
    lr_wsd_decay_iters: int | None = arg(None, "Cool-down iterations of WSD.")
    lr_wsd_decay_samples: int | None = arg(None, "Cool-down samples of WSD (sample-based).")
    decoupled_lr: float | None = arg(None, "Peak learning rate of the input embedding and "
                                     "output layer (their own schedule, same shape).")
    decoupled_min_lr: float | None = arg(None, "Minimum learning rate of the input embedding "
                                         "and output layer (default --min-lr).")
    weight_decay: float = arg(0.01, "Weight decay (not applied to norms and biases).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    sgd_momentum: float = arg(0.9, "SGD momentum.")
    lion_beta1: float = arg(0.95, "Lion's beta1: the weight of the momentum in the sign "
                            "of the update.")
    lion_beta2: float = arg(0.98, "Lion's beta2: the decay of its momentum (an EMA of the "
                            "gradients).")
    muon_momentum: float = arg(0.95, "Muon's momentum (an EMA of the gradients).")
    muon_nesterov: bool = arg(False, "Nesterov-style momentum in Muon.",
                              aliases=("--muon-use-nesterov",))
    muon_split_qkv: bool = arg(True, "Orthogonalise Q, K and V of a fused QKV weight as "
                               "one matrix instead of each apart.",
                               flag="--muon-no-split-qkv", action="store_false")
    muon_num_ns_steps: int = arg(5, "Newton-Schulz steps of Muon.")
    muon_coefficient_type: str = arg("quintic", "Newton-Schulz coefficient set of Muon.",
                                     choices=_coefficient_types)
    muon_scale_mode: str = arg("spectral", "Scale of Muon's orthogonalised update by the "
                               "matrix shape.",
                               choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_extra_scale_factor: float = arg(1.0, "Extra factor on Muon's update (0.2 matches "
                                         "AdamW's update RMS under spectral scaling).")
    muon_tp_mode: str = arg("duplicated", "How Muon orthogonalises a tensor-parallel "
                            "matrix: duplicated (gather, orthogonalise on every tp rank), "
                            "distributed (Newton-Schulz over the tp shards), blockwise "
                            "(each shard apart: depends on tp).", choices=MUON_TP_MODES)
    muon_scalar_optimizer: str = arg("adam", "Optimizer of the parameters Muon does not "
                                     "orthogonalise (embeddings, output layer, norms, "
                                     "biases, router).", choices=("adam", "lion"))
    muon_fp32_matmul_prec: str = arg(
        "medium", "Matmul precision of Muon's Newton-Schulz iteration on GPUs: high runs "
        "it in TF32, medium (and low) on bf16 copies, as Megatron-LM does; the CPU runs it "
        "in IEEE fp32.", choices=("low", "medium", "high"))
    clip_grad: float = arg(1.0, "Clip gradients to this global norm (0 disables).")
    loss_scale: float | None = arg(None, "Static loss scale (fp16); dynamic when unset.")
    initial_loss_scale: float = arg(2.0 ** 32, "Initial dynamic loss scale.")
    min_loss_scale: float = arg(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = arg(1000, "Steps without overflow before doubling the scale.")
    hysteresis: int = arg(2, "Overflows tolerated before halving the scale.")
    optimizer_cpu_offload: bool = arg(False, "Keep the fp32 main parameters and optimizer "
                                      "state of --optimizer-offload-fraction of the "
                                      "parameters in (pinned) host memory and step them on "
                                      "the CPU.")
    optimizer_offload_fraction: float = arg(1.0, "Fraction of the parameters (by elements) "
                                            "whose optimizer state --optimizer-cpu-offload "
                                            "moves to the host.")

    def __post_init__(self) -> None:
        check_choices(self)
        require(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        require(0 <= self.min_lr <= max(self.lr, self.min_lr),
                 f"min_lr must be >= 0, got {self.min_lr}")
        require(self.min_lr <= self.lr,
                 f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        require(self.lr_warmup_iters >= 0, "lr_warmup_iters must be >= 0")
        require(self.lr_warmup_samples >= 0, "lr_warmup_samples must be >= 0")
        require(self.lr_warmup_init >= 0,
                f"--lr-warmup-init must be >= 0, got {self.lr_warmup_init}")
        if self.lr_warmup_fraction is not None:
            require(self.lr_warmup_iters == 0,
                     "give either --lr-warmup-fraction or --lr-warmup-iters, not both")
            require(self.lr_warmup_samples == 0,
                     "give either --lr-warmup-fraction or --lr-warmup-samples, not both")
            require(0 <= self.lr_warmup_fraction <= 1,
                     f"lr_warmup_fraction must be in [0, 1], got {self.lr_warmup_fraction}")
        for iters, samples in (("lr_decay_iters", "lr_decay_samples"),
                               ("lr_warmup_iters", "lr_warmup_samples"),
                               ("lr_wsd_decay_iters", "lr_wsd_decay_samples")):
            require(not getattr(self, iters) or not getattr(self, samples),
                     f"give either --{iters.replace('_', '-')} or "
                     f"--{samples.replace('_', '-')}, not both")
        if self.decoupled_lr is not None:
            require(self.decoupled_lr >= 0, f"decoupled_lr must be >= 0, got {self.decoupled_lr}")
        if self.decoupled_min_lr is not None:
            require(self.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")
            require(0 <= self.decoupled_min_lr <= self.decoupled_lr,
                     f"decoupled_min_lr ({self.decoupled_min_lr}) must be in [0, decoupled_lr "
                     f"({self.decoupled_lr})]")
        require(self.weight_decay >= 0, "weight_decay must be >= 0")
        require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
                 "adam betas must be in [0, 1)")
        require(0 <= self.lion_beta1 < 1 and 0 <= self.lion_beta2 < 1,
                f"--lion-beta1 and --lion-beta2 must be in [0, 1), got {self.lion_beta1} "
                f"and {self.lion_beta2}")
        require(self.clip_grad >= 0, "clip_grad must be >= 0 (0 disables clipping)")
        self._check_muon()
        self._check_lion()
        require(0.0 <= self.optimizer_offload_fraction <= 1.0,
                "optimizer_offload_fraction must be in [0, 1], got "
                f"{self.optimizer_offload_fraction}")
        require(self.optimizer_cpu_offload or self.optimizer_offload_fraction == 1.0,
                f"--optimizer-offload-fraction {self.optimizer_offload_fraction} has no effect "
                "without --optimizer-cpu-offload (the fraction says how much of the optimizer "
                "state the offload moves to the host); add --optimizer-cpu-offload, or drop "
                "--optimizer-offload-fraction")
        for name in ("loss_scale", "initial_loss_scale"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= FP32_MAX:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {value:g} is not a usable loss scale: it "
                    f"must be above 0 and a finite fp32 number (at most {FP32_MAX:.4g}); "
                    "loss scales are powers of two such as 65536 (2^16)")
        positive(self, "loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis",
                  "lr_decay_iters", "lr_wsd_decay_iters", "lr_decay_samples",
                  "lr_wsd_decay_samples")

    def _check_lion(self) -> None:
        changed = [f"--{name.replace('_', '-')}" for name in ("lion_beta1", "lion_beta2")
                   if getattr(self, name) != OptimConfig.__dataclass_fields__[name].default]
        require(uses_lion(self.optimizer, self.muon_scalar_optimizer) or not changed,
                f"{changed[0] if changed else ''} has no effect with --optimizer "
                f"{self.optimizer}; use --optimizer lion (or --optimizer muon "
                "--muon-scalar-optimizer lion), or drop the Lion flags")

    def _check_muon(self) -> None:
        from megalite.optim.newton_schulz import steps_problem

        if self.optimizer != "muon":
            changed = [f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                       for f in dataclasses.fields(self) if f.name.startswith("muon_")
                       and getattr(self, f.name) != f.default]
            require(not changed, f"{changed[0] if changed else ''} has no effect with "
                    f"--optimizer {self.optimizer}; use --optimizer muon or drop the Muon "
                    "flags")
            return
        require(0 <= self.muon_momentum < 1,
                f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        problem = steps_problem(self.muon_coefficient_type, self.muon_num_ns_steps)
        require(problem is None, problem or "")
