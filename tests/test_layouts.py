"""The layout table itself (``tests/layouts.py``): unique names, known suites, and every
row a layout that megalite's own config validation accepts for its world size."""

import pytest

from tests.layouts import LAYOUTS, SUITES, Layout, layouts, slug, tiny


def test_names_are_unique_and_derived_from_the_fields():
    names = [r.name for r in LAYOUTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for r in LAYOUTS:
        assert r.name.startswith(f"{r.tags[0]}-{slug(r.world_size, r.parallel)}"), r.name


def test_every_suite_has_rows_and_every_row_a_suite():
    assert {r.tags[0] for r in LAYOUTS} == set(SUITES)
    assert sum(len(layouts(suite)) for suite in SUITES) == len(LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_row_resolves_to_its_layout(layout):
    """Every row is a layout megalite's config validation accepts for its world size, and
    its resolved layout has the row's sizes: the world factors into them, the experts
    regroup the dense ranks, every layer is on exactly one pipeline chunk, and the global
    batch is micro-batches x micro-batch size x dp."""
    assert 1 <= layout.world_size <= 8
    cfg = tiny(layout)   # ModelConfig / ParallelConfig checks, then validate(world_size)
    lay = cfg.resolve(layout.world_size)
    assert [getattr(lay, s) for s in ("tp", "pp", "cp", "ep", "etp")] == \
        [layout.get(s) for s in ("tp", "pp", "cp", "ep", "etp")]
    # zbv derives its two chunks per rank (the V) when the row gives no virtual size
    assert lay.vpp == (layout.get("vpp") or (2 if lay.v_shape else 1))
    assert lay.dp == layout.dp >= 1
    assert lay.tp * lay.cp * lay.dp * lay.pp == layout.world_size
    assert lay.etp * lay.ep * lay.edp == lay.tp * lay.cp * lay.dp
    assert all(len(chunks) == lay.vpp for chunks in lay.stage_chunks)
    held = sorted(i for r in range(lay.pp) for i in lay.stage_layers(r))
    assert held == list(range(cfg.model.num_layers))
    assert lay.num_microbatches * lay.micro_batch_size * lay.dp == lay.global_batch_size


def test_a_row_pastes_back():
    """``repr`` of a row is the Python that builds it (a failing fuzz draw becomes a row)."""
    for r in LAYOUTS:
        assert eval(repr(r), {"Layout": Layout}) == r
