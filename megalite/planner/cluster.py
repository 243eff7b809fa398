"""The machine a layout runs on: sizes, memory, peak FLOP/s and bandwidths, with presets.

Bandwidths are per GPU, bytes/s, one direction: ``intra_node_bw`` between GPUs of a node
(NVLink), ``inter_node_bw`` of each GPU's share of the network (InfiniBand / RoCE NIC).
``matmul_efficiency`` is the fraction of ``peak_flops`` a large bf16 GEMM reaches;
``memory_efficiency`` the same for ``memory_bw`` and the memory-bound work the planner
counts (its activations' passes, the optimizer's state, fp8's quantisations,
:mod:`megalite.planner.time`): the time of the step's memory-bound kernels is that traffic
at ``memory_bw x memory_efficiency``. The count is a floor (each saved activation byte
written and read in forward and backward, not every intermediate an element-wise kernel
reads), so the fraction is also what the count leaves out. The GPU presets' 0.3 is fitted
to an H200's compiled steps: with it the ``h200`` preset gives six measured steps (a 1.1B
Llama at one and at 16 micro-batches a step, in bf16, fp8 tensorwise and with Muon, and
eight of Llama-3 8B's layers in bf16 and fp8) within 3%, where 1.0 left them 18-42% short
(``docs/planner.md``); the other GPUs are assumed alike. 1.0 elsewhere: a custom cluster,
and the CPU check, which measures its layers' rate with their memory-bound work in it.
``latency_s`` the fixed cost of one collective (per ring hop).

Fixed costs that do not shrink with the work, which dominate small models (on a GPU the
kernel launches, on a CPU the framework's per-operator dispatch), per rank:
``layer_overhead_s`` of one transformer layer's forward and backward for one micro-batch,
``layer_forward_overhead_s`` of its forward alone (what full recomputation repeats),
``microbatch_overhead_s`` of the rest of a micro-batch (embedding, output layer, loss).
The presets leave them 0 (hidden by asynchronous launches on a GPU at these sizes); the
CPU check measures them (:class:`megalite.planner.measure.OverheadProbe`).
``collective_overhead_s`` is the same kind of cost for communication: what one blocking
collective issued between compute costs beyond ``latency_s`` and its bytes. On a CPU with
gloo it is large (the collective wakes gloo's worker and transport threads on cores the
ranks compute on, and a rank that arrives first waits for the other's compute), measured
by :func:`megalite.planner.measure.tp_collective_cost`; 0 in the presets (NCCL kernels
queue behind the compute on their own stream).

``fp32_flops`` times the fp32 matmuls megalite runs besides the training dtype's (the
``--qk-clip`` score pass, :mod:`megalite.planner.qk_clip`): the GPU's non-tensor-core
fp32 rate, as torch runs fp32 matmuls at its default precision.

``fp32_flops`` also times the fp8 GEMMs megalite emulates (the dequantised operands
multiplied in fp32: ``mxfp8`` everywhere, ``blockwise`` where ``fp8_block_kernel`` is
False and its e5m2 gradient GEMMs everywhere; :mod:`megalite.planner.fp8_time`).

``host_bw`` (bytes/s per GPU, one direction, PCIe) and ``host_memory_bw`` (each GPU's
share of the host's memory bandwidth) time ``--optimizer-cpu-offload``: the offloaded
gradients go to the host and the parameters come back, and the host steps Adam.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megalite.config.fields import ConfigError

GIB = 2 ** 30

# fields that must be positive numbers (bandwidths may be inf: no limit); the fractions
# must also be at most 1
_POSITIVE = ("gpu_memory", "peak_flops", "intra_node_bw", "inter_node_bw", "memory_bw",
             "host_bw", "host_memory_bw", "matmul_efficiency", "memory_margin",
             "memory_efficiency")
FRACTIONS = ("matmul_efficiency", "memory_margin", "memory_efficiency")


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    nodes: int
    gpu_memory: float          # bytes usable per GPU
    peak_flops: float          # dense bf16 FLOP/s per GPU
    intra_node_bw: float       # bytes/s per GPU, one direction
    inter_node_bw: float       # bytes/s per GPU, one direction
    matmul_efficiency: float = 0.7
    latency_s: float = 10e-6
    memory_bw: float = 2.0e12  # bytes/s of device memory (memory-bound work)
    layer_overhead_s: float = 0.0
    layer_forward_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    host_bw: float = 25e9      # PCIe 4/5 x16, about half its peak in practice
    host_memory_bw: float = 25e9
    memory_margin: float = 0.9  # fraction of gpu_memory a layout may plan for (the CUDA
                                # context, allocator fragmentation and NCCL take the rest)
    name: str = "custom"
    fp8_flops: float = 0.0     # dense fp8 FLOP/s per GPU; 0: the GPU has no fp8 GEMMs
    fp32_flops: float = 0.0    # fp32 matmul FLOP/s per GPU (torch's default "highest"
                               # precision: no TF32); 0: peak_flops (a CPU run in fp32)
    fp8_block_kernel: bool = False  # the GPU has torch's 1 x 128 block-scaled fp8 GEMM
                                    # (compute capability 9.0, Hopper): --fp8-recipe
                                    # blockwise runs its e4m3 GEMMs there, not in fp32
    memory_efficiency: float = 1.0  # fraction of memory_bw the memory-bound work reaches

    def __post_init__(self) -> None:
        """Refuse sizes below one and non-positive or NaN rates (a step time from them
        would be negative or NaN, and the ranking meaningless)."""
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster {name} must be an integer >= 1, got {value!r}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if not (value > 0) or (name in FRACTIONS and value > 1):
                limit = "in (0, 1]" if name in FRACTIONS else "a positive number"
                raise ConfigError(f"cluster {name} must be {limit}, got {value!r}")
        for name in ("latency_s", "layer_overhead_s", "layer_forward_overhead_s",
                     "microbatch_overhead_s", "collective_overhead_s"):
            if math.isnan(getattr(self, name)):
                raise ConfigError(f"cluster {name} must be a number, got nan")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_rate(self) -> float:
        """Bytes/s of the memory-bound work the planner counts: ``memory_bw x
        memory_efficiency``."""
        return self.memory_bw * self.memory_efficiency

    def group_bw(self, size: int, stride: int) -> float:
        """Bandwidth of a group of ``size`` ranks ``stride`` apart in the global rank order
        (ranks fill nodes in order): NVLink when the group fits in a node, else the
        network."""
        if size <= 1:
            return float("inf")
        return self.intra_node_bw if size * stride <= self.gpus_per_node else \
            self.inter_node_bw

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, nodes=nodes)


GPU_MEMORY_EFFICIENCY = 0.3   # fitted to an H200's compiled steps (module docstring)


# per-GPU figures: NVLink 4 (H100/H200) 450 GB/s and NVLink 3 (A100) 300 GB/s one way;
# one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU; the H800 is an H100 with NVLink
# cut to 200 GB/s one way (400 GB/s both ways)
PRESETS = {
    "h100": Cluster(8, 1, 80 * GIB, 989e12, 450e9, 50e9, memory_bw=3.35e12, name="H100 SXM",
                    fp8_flops=1979e12, fp32_flops=67e12, fp8_block_kernel=True,
                    memory_efficiency=GPU_MEMORY_EFFICIENCY),
    "h800": Cluster(8, 1, 80 * GIB, 989e12, 200e9, 50e9, memory_bw=3.35e12, name="H800 SXM",
                    fp8_flops=1979e12, fp32_flops=67e12, fp8_block_kernel=True,
                    memory_efficiency=GPU_MEMORY_EFFICIENCY),
    "h200": Cluster(8, 1, 141 * GIB, 989e12, 450e9, 50e9, memory_bw=4.8e12, name="H200 SXM",
                    fp8_flops=1979e12, fp32_flops=67e12, fp8_block_kernel=True,
                    memory_efficiency=GPU_MEMORY_EFFICIENCY),
    "a100": Cluster(8, 1, 80 * GIB, 312e12, 300e9, 25e9, memory_bw=2.0e12,
                    name="A100 SXM 80GB", fp32_flops=19.5e12,
                    memory_efficiency=GPU_MEMORY_EFFICIENCY),
}


def preset(name: str, nodes: int = 1) -> Cluster:
    """A preset node type (``h100``, ``h800``, ``h200``, ``a100``) times ``nodes``."""
    try:
        return PRESETS[name.lower()].with_nodes(nodes)
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; one of {sorted(PRESETS)}") from None
