"""What this rank's hardware can compute: the table of accelerator peaks and the matmul
probe, the one place MFU's denominator comes from.

    peak, source = peak_flops_per_rank(device)       # the training loop's MFU peak
    probe = MatmulPeak(n=2048); probe.probe(0.5)      # best n x n torch.mm FLOP/s so far

On CUDA the peak is the dense half-precision tensor-core figure of the device's name in
:data:`GPU_PEAK_FLOPS`; on a CPU (or a GPU not in the table) it is measured: the best
``torch.mm`` rate of ``n x n`` matrices over short bursts, so the figure reflects the
cores this rank really gets (and the background load at the time of the probe).
"""

from __future__ import annotations

import time

import torch

# Dense half-precision peaks (FLOP/s) of common accelerators, by substring of the name.
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
    "H800": 989e12, "L40S": 362e12, "L40": 181e12, "A6000": 155e12, "A10": 125e12,
    "V100": 125e12, "4090": 165e12, "3090": 71e12, "T4": 65e12, "MI300X": 1307e12,
    "MI250": 362e12, "B200": 2250e12,
}


def table_peak(device: torch.device) -> tuple[float | None, str]:
    """(table peak FLOP/s of ``device``'s name, the name) on CUDA; (None, why) otherwise."""
    if device.type != "cuda":
        return None, f"{device.type} (no table peak)"
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_FLOPS.items():
        if key in name:
            return peak, name
    return None, f"{name} (not in the peak table)"


class MatmulPeak:
    """Best FLOP/s of ``torch.mm`` on ``n x n`` matrices of ``dtype`` on ``device``, kept
    over every :meth:`probe` (so probes taken between timed steps see the steps' load).

    A burst is ``burst`` products timed together (synchronised on CUDA)."""

    def __init__(self, n: int = 512, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", burst: int = 2):
        self.device = torch.device(device)
        self.a = torch.randn(n, n, dtype=dtype, device=self.device)
        self.b = torch.randn(n, n, dtype=dtype, device=self.device)
        self.n, self.burst, self.best = n, burst, 0.0
        torch.mm(self.a, self.b)   # warm up

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def probe(self, seconds: float = 0.5) -> float:
        """Bursts for about ``seconds``; returns the best rate seen so far."""
        end = time.perf_counter() + seconds
        while True:
            self._sync()
            start = time.perf_counter()
            for _ in range(self.burst):
                torch.mm(self.a, self.b)
            self._sync()
            now = time.perf_counter()
            self.best = max(self.best, 2.0 * self.burst * self.n ** 3 / (now - start))
            if now >= end:
                return self.best


def matmul_peak(n: int = 512, seconds: float = 1.0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> float:
    """Best ``torch.mm`` FLOP/s of one :class:`MatmulPeak` probe of about ``seconds``."""
    return MatmulPeak(n, dtype, device).probe(seconds)


def peak_flops_per_rank(device: torch.device, probe_seconds: float = 1.0) -> tuple[float, str]:
    """(peak FLOP/s of one rank, how it was obtained) for MFU: the table on a known GPU,
    else a fp32 probe of ``probe_seconds`` on this rank.

    The global torch RNG is restored after the probe, so a run's random stream does not
    depend on whether the probe ran.
    """
    peak, name = table_peak(device)
    if peak is not None:
        return peak, f"{name} bf16 peak {peak / 1e12:.0f} TFLOP/s (table)"
    state = torch.get_rng_state()
    try:
        peak = matmul_peak(seconds=probe_seconds)
    finally:
        torch.set_rng_state(state)
    return peak, (f"measured fp32 torch.mm peak {peak / 1e9:.1f} GFLOP/s per rank "
                  f"({torch.get_num_threads()} threads, {probe_seconds:.1f} s probe)")
