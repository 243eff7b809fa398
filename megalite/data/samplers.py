"""Data-parallel batch sampling that keeps global batches independent of the DP size.

The sample order is the dataset's own (already shuffled by its seed). Sample indices are
consumed in consecutive chunks of ``micro_batch_size * data_parallel_size``; rank r takes
the r-th ``micro_batch_size`` slice of each chunk (Megatron's MegatronPretrainingSampler).
So a global batch of B samples is always samples ``[k*B, (k+1)*B)`` whatever the DP size,
and resuming from ``consumed_samples`` continues the same stream.
"""

from __future__ import annotations

import torch


class PretrainingSampler:
    """Yields, for one DP rank, lists of ``micro_batch_size`` dataset indices.

    total_samples:    length of the dataset (indices beyond are never produced)
    consumed_samples: samples all ranks together have already used (resume point)
    drop_last:        drop a final incomplete chunk (default); otherwise each rank gets its
                      part of it, possibly empty ranks skipped
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int,
                 drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                             f"({data_parallel_size}) must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} out of range for "
                             f"data_parallel_size {data_parallel_size}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) must be in [0, "
                             f"{total_samples}): the dataset is exhausted")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.world = data_parallel_size
        self.drop_last = drop_last

    @property
    def chunk(self) -> int:
        return self.micro_batch_size * self.world

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.chunk
        if self.drop_last or remaining % self.chunk == 0:
            return full
        lo = self.rank * self.micro_batch_size
        return full + int(remaining % self.chunk > lo)

    def __iter__(self):
        lo = self.rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.chunk):
            stop = min(start + self.chunk, self.total_samples)
            if stop - start < self.chunk and self.drop_last:
                return
            batch = list(range(start + lo, min(start + lo + self.micro_batch_size, stop)))
            if batch:
                yield batch


def build_data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                      dp_size: int, num_workers: int = 0,
                      device: torch.device | str = "cpu") -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` yielding this rank's micro-batches (dicts of tensors
    with a leading ``micro_batch_size`` dimension), resuming at ``consumed_samples``.
    ``device``: where the batches go (``ps.device``); pinned host memory only for a CUDA
    device (pinning creates a CUDA context, which a ``--device cpu`` run on a GPU host
    must not)."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank,
                                 dp_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.device(device).type == "cuda",
                                       persistent_workers=num_workers > 0)
