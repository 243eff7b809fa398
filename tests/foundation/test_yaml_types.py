"""YAML values get the command line's types and choices."""

from __future__ import annotations

import pytest

from megalite.arguments import ArgumentError, parse_args


def _cfg(tmp_path, text, *argv):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    return parse_args(["--config", str(f), *argv])


@pytest.mark.parametrize("text,want", [
    ("bf16: 'false'", False), ("bf16: 'true'", True), ("bf16: 'no'", False),
    ("bf16: 'yes'", True), ("bf16: '0'", False), ("bf16: '1'", True),
    ("bf16: false", False), ("bf16: true", True), ("bf16: 'FALSE'", False),
])
def test_boolean_strings(tmp_path, text, want):
    assert _cfg(tmp_path, text).model.bf16 is want


@pytest.mark.parametrize("text", ["bf16: maybe", "bf16: 2", "bf16: 0.5", "bf16: [1]"])
def test_bad_booleans_name_key_value_and_type(tmp_path, text):
    with pytest.raises(ArgumentError, match=r"bf16: .* expected a boolean"):
        _cfg(tmp_path, text)


def test_numbers_convert_like_the_command_line(tmp_path):
    cfg = _cfg(tmp_path, "num_layers: '2'\nlr: 1e-4\nmin_lr: '1e-5'\nhidden_size: 64\n"
                         "weight_decay: 0\n")
    assert cfg.model.num_layers == 2 and isinstance(cfg.model.num_layers, int)
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1: a string
    assert cfg.optim.min_lr == 1e-5
    assert cfg.optim.weight_decay == 0.0 and isinstance(cfg.optim.weight_decay, float)


@pytest.mark.parametrize("text,pattern", [
    ("num_layers: 2.5", r"num_layers: 2\.5 is not valid; expected an integer"),
    ("num_layers: 'two'", r"num_layers: 'two' is not valid; expected an integer"),
    ("num_layers: true", r"num_layers: True is not valid; expected an integer"),
    ("lr: fast", r"lr: 'fast' is not valid; expected a number"),
    ("num_layers: null", r"num_layers: null is not allowed; expected an integer"),
    ("tokenizer_type: true", r"tokenizer_type: True is not valid; expected a string"),
    ("position_embedding_type: sideways", r"position_embedding_type: 'sideways' is not one"),
])
def test_wrong_types_name_key_value_and_type(tmp_path, text, pattern):
    with pytest.raises(ArgumentError, match=pattern) as e:
        _cfg(tmp_path, text)
    assert "c.yaml" in str(e.value)


def test_lists_take_a_yaml_list_or_a_string(tmp_path):
    a = _cfg(tmp_path, "data_path: [0.3, a, 0.7, b]\n")
    b = _cfg(tmp_path, "data_path: '0.3 a 0.7 b'\n")
    assert a.data.data_path == b.data.data_path == ["0.3", "a", "0.7", "b"]
    c = _cfg(tmp_path, "profile_ranks: '0 1'\n")
    assert c.logging.profile_ranks == [0, 1]
    with pytest.raises(ArgumentError, match=r"profile_ranks: .* expected a list .* integers"):
        _cfg(tmp_path, "profile_ranks: [0, x]\n")


def test_yaml_matches_the_command_line(tmp_path):
    yaml_cfg = _cfg(tmp_path, "num_layers: '3'\nlr: '0.01'\nbf16: 'true'\n")
    cli_cfg = parse_args(["--num-layers", "3", "--lr", "0.01", "--bf16"])
    assert yaml_cfg.to_dict() == cli_cfg.to_dict()
