"""Model FLOPs per token and the hardware peak used for MFU.

MFU = (model FLOPs of one iteration / iteration time) / (peak FLOP/s per rank x ranks).

Model FLOPs follow the PaLM / Megatron-LM count per token: ``6 N`` for the matmuls of the
``N`` transformer-layer parameters (forward 2N, backward 4N), ``6 h V`` for the output
layer (hidden h, padded vocabulary V) and ``12 L h s`` for the attention scores and values
(L layers, sequence s). ``N`` counts each parameter of the whole model once
(tensor-parallel shards summed, replicated parameters once) and leaves out embedding
tables (a lookup) and the output layer (counted as ``h V``): names containing
``embedding`` or ``output_layer``.

The peak: on CUDA a table of dense bf16/fp16 tensor-core peaks by device name; on CPU (or
an unknown GPU) a short fp32 ``torch.mm`` probe measured once at start-up on this rank, so
the CPU figure already reflects how many cores each rank gets.
"""

from __future__ import annotations

import time

import torch

from megalite.optim.clip_grads import counts_in_norm
from megalite.parallel.collectives import all_reduce_scalar
from megalite.parallel.state import ParallelState

# Dense half-precision peaks (FLOP/s) of common accelerators, by substring of the name.
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
    "H800": 989e12, "L40S": 362e12, "L40": 181e12, "A6000": 155e12, "A10": 125e12,
    "V100": 125e12, "4090": 165e12, "3090": 71e12, "T4": 65e12, "MI300X": 1307e12,
    "MI250": 362e12, "B200": 2250e12,
}


def count_layer_params(model: torch.nn.Module, ps: ParallelState) -> int:
    """Parameters of the whole model but embeddings and output layer, each counted once
    (SUM over ``ps.mp``)."""
    local = sum(p.numel() for name, p in model.named_parameters()
                if counts_in_norm(p, ps) and "embedding" not in name
                and "output_layer" not in name)
    return int(all_reduce_scalar(local, ps.mp, device=ps.device))


def flops_per_token(layer_params: int, num_layers: int, hidden_size: int, seq_length: int,
                    vocab_size: int) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N + 6 h V + 12 L h s``."""
    return (6.0 * layer_params + 6.0 * hidden_size * vocab_size
            + 12.0 * num_layers * hidden_size * seq_length)


def measure_cpu_matmul_flops(seconds: float = 1.0, n: int = 512) -> float:
    """fp32 FLOP/s of ``torch.mm`` on ``n x n`` matrices over about ``seconds``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * n ** 3 * count / elapsed


def peak_flops_per_rank(device: torch.device, probe_seconds: float = 1.0) -> tuple[float, str]:
    """(peak FLOP/s of one rank, how it was obtained) for MFU.

    The global torch RNG is restored after the probe, so a run's random stream does not
    depend on whether the probe ran.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in name:
                return peak, f"{name} bf16 peak {peak / 1e12:.0f} TFLOP/s (table)"
    state = torch.get_rng_state()
    try:
        peak = measure_cpu_matmul_flops(probe_seconds)
    finally:
        torch.set_rng_state(state)
    return peak, (f"measured fp32 torch.mm peak {peak / 1e9:.1f} GFLOP/s per rank "
                  f"({torch.get_num_threads()} threads, {probe_seconds:.1f} s probe)")
