"""PretrainingSampler: global batches independent of the DP size, and resumption."""

from __future__ import annotations

import pytest
import torch

from megalite.data.samplers import PretrainingSampler, build_data_loader


def global_batches(total, consumed, mbs, dp):
    """The global batches (sorted sample ids per step) that dp ranks see together."""
    per_rank = [list(PretrainingSampler(total, consumed, mbs, r, dp)) for r in range(dp)]
    assert len({len(batches) for batches in per_rank}) == 1
    return [[i for r in range(dp) for i in per_rank[r][step]]
            for step in range(len(per_rank[0]))]


@pytest.mark.parametrize("total", [64, 70])
def test_global_batches_do_not_depend_on_dp(total):
    gbs = 8
    reference = [list(range(k * gbs, (k + 1) * gbs)) for k in range(total // gbs)]
    for dp in (1, 2, 4):
        mbs = gbs // dp
        batches = global_batches(total, 0, mbs, dp)  # one micro-batch per rank per step
        assert batches == reference
        for r in range(dp):
            sampler = PretrainingSampler(total, 0, mbs, r, dp)
            assert len(sampler) == len(list(sampler))
            first = next(iter(sampler))
            assert first == list(range(r * mbs, (r + 1) * mbs))


def test_resume_from_consumed_samples():
    full = global_batches(100, 0, 2, 2)
    resumed = global_batches(100, 40, 2, 2)
    assert resumed == full[10:]
    # with gradient accumulation the micro-batches still tile the same stream
    assert global_batches(100, 40, 1, 4) == full[10:]


def test_bad_arguments():
    with pytest.raises(ValueError, match="exhausted"):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2 out of range"):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_data_loader_batches_dicts():
    class Toy(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"tokens": torch.full((3,), i, dtype=torch.int64)}

    loader = build_data_loader(Toy(), consumed_samples=4, micro_batch_size=2, dp_rank=1,
                               dp_size=2, num_workers=0)
    batches = [b["tokens"][:, 0].tolist() for b in loader]
    assert batches == [[6, 7], [10, 11], [14, 15], [18, 19]]
    assert next(iter(loader))["tokens"].shape == (2, 3)
