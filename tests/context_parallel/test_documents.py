"""Document masks under context parallelism (``--reset-attention-mask``,
``--reset-position-ids``, ``--eod-mask-loss``): the mask, positions and loss mask follow
the tokens to their cp ranks, and the cp run trains the single-process model.

The data: samples of random tokens in which about one token in six is the end of a
document (so every sample holds several documents), itemised by the real
``megalite.data.gpt_dataset.make_item`` (which builds Megatron's ``[1, s, s]`` mask).
"""

import dataclasses

import numpy as np
import pytest
import torch

from megalite.data.gpt_dataset import GPTDatasetConfig, make_item
from megalite.parallel.cp_chunks import with_document_ids
from tests.distributed.harness import run_distributed
from tests.fuzz import check
from tests.layouts import layouts

VOCAB = 61          # the NullTokenizer's 60 + eod (60)
EOD = VOCAB - 1
ROWS = layouts("cp", where=lambda r: bool(r.data))


class ManyDocuments(torch.utils.data.Dataset):
    """Random tokens, about one in six an eod, itemised with the run's data flags."""

    def __init__(self, seq_length: int, n: int, seed: int, data_cfg):
        rng = np.random.default_rng(seed)
        self.texts = rng.integers(0, EOD, size=(n, seq_length + 1))
        self.texts[rng.random(self.texts.shape) < 1 / 6] = EOD
        self.config = GPTDatasetConfig(
            seq_length=seq_length, seed=seed, eod=EOD, pad=EOD,
            reset_position_ids=data_cfg.reset_position_ids,
            reset_attention_mask=data_cfg.reset_attention_mask,
            eod_mask_loss=data_cfg.eod_mask_loss)

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return make_item(self.texts[i], len(self.texts[i]), self.config)


def many_documents(cfg, tokenizer=None):
    n = cfg.train.global_batch_size * cfg.train.train_iters
    return ManyDocuments(cfg.model.seq_length, n, cfg.train.seed, cfg.data), None, None


def _train(layout):
    """``check.train_and_gather`` of ``layout`` on the many-documents data."""
    original = check.datasets
    check.datasets = many_documents
    try:
        return check.train_and_gather(layout)
    finally:
        check.datasets = original


def _body(rank, world_size, layout):
    return _train(layout)


def test_document_ids_from_the_mask():
    from megalite.config import DataConfig

    data = DataConfig(reset_attention_mask=True, reset_position_ids=True)
    item = ManyDocuments(16, 1, 0, data)[0]
    batch = with_document_ids({k: v[None] for k, v in item.items()})
    doc = batch["document_ids"][0]
    mask = item["attention_mask"][0]
    same = (doc[:, None] == doc[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(~same, mask) and doc.unique().numel() > 1
    # the ids are where each document starts: position ids reset there
    assert torch.equal(torch.arange(16) - doc, item["position_ids"])


@pytest.mark.parametrize("layout", ROWS, ids=str)
def test_cp_with_document_masks_matches_single_process(layout):
    ref = _train(check.reference_layout(layout))
    ranks = run_distributed(layout.world_size, _body, layout)
    problems = check.compare(layout, ranks, ref)
    assert not problems, problems[:5]
    # the masks matter: the same model and data without them learns something else
    plain = _train(dataclasses.replace(check.reference_layout(layout), data={}))
    assert abs(plain[0][3] - ref[0][3]) > 1e-3, (plain[0], ref[0])
