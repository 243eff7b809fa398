"""The layout table itself (``tests/layouts.py``): unique names, known suites, and every
row a layout that megalite's own config validation accepts for its world size."""

import pytest

from megalite.config.layout import chunk_layer_ranges
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
def test_row_is_a_valid_layout(layout):
    assert 1 <= layout.world_size <= 8
    cfg = tiny(layout)   # ModelConfig / ParallelConfig checks, then validate(world_size)
    p = cfg.parallel
    assert layout.dp == p.data_parallel_size(layout.world_size) >= 1
    chunk_layer_ranges(cfg.model.num_layers, p.pipeline_model_parallel_size,
                       p.virtual_pipeline_model_parallel_size,
                       p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)


def test_a_row_pastes_back():
    """``repr`` of a row is the Python that builds it (a failing fuzz draw becomes a row)."""
    for r in LAYOUTS:
        assert eval(repr(r), {"Layout": Layout}) == r
