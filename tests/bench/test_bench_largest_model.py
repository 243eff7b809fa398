"""tools/benchmark.py largest-model on a tiny GPT: predicted layer counts for every
strategy and offload megalite accepts, with offload fitting more on a GPU; and one variant
confirmed by training it on 2 gloo ranks under the cap."""

from megalite.config.parallel import SHARDING_STRATEGIES
from tools.bench import largest_model as bench

SHAPE = ["--hidden-size", "64", "--seq-length", "32", "--vocab-size", "256"]


def test_predictions_per_variant(capsys):
    rows = bench.main(SHAPE + ["--cap-gib", "0.01", "--machine-gib", "0.02",
                               "--max-layers", "128", "--no-confirm"])
    capsys.readouterr()
    assert {(s, "none") for s in SHARDING_STRATEGIES} <= set(rows)
    assert {(s, o) for s in SHARDING_STRATEGIES if s != "no_shard" for o in bench.OFFLOADS} \
        <= set(rows)
    for key, row in rows.items():
        assert 0 < row["cap"] < 128 and row["confirmed"] is None, key
        # the GPU column caps device bytes only: offload moves bytes off the device
    for strategy in SHARDING_STRATEGIES:
        if strategy != "no_shard":
            assert rows[(strategy, "opt")]["gpu"] > rows[(strategy, "none")]["gpu"]
            assert rows[(strategy, "none")]["gpu"] > rows[("no_shard", "none")]["gpu"]
        assert rows[(strategy, "act")]["gpu"] >= rows[(strategy, "none")]["gpu"]


def test_confirms_one_variant_under_the_cap(capsys):
    rows = bench.main(SHAPE + ["--cap-gib", "0.5", "--max-layers", "4",
                               "--only", "optim/none"])
    out = capsys.readouterr().out
    assert list(rows) == [("optim", "none")]
    row = rows[("optim", "none")]
    assert row["cap"] == row["confirmed"] == 4, out
    assert 0 < row["peak"] <= 0.5 * bench.GIB
