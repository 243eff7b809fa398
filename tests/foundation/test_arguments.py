"""Megatron flag names, YAML files, and helpful errors."""

import subprocess
import sys

import pytest

from megalite.arguments import ArgumentError, build_parser, parse_args

MEGATRON_FLAGS = """
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
--num-layers-per-virtual-pipeline-stage 1 --sequence-parallel --context-parallel-size 1
--expert-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--micro-batch-size 2 --global-batch-size 16 --train-iters 100 --lr 3e-4 --min-lr 3e-5
--lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --bf16
--data-path 0.3 prefixA 0.7 prefixB --split 98,2,0 --tokenizer-type SentencePieceTokenizer
--tokenizer-model tok.model --save ckpt --load ckpt --save-interval 50 --log-interval 5
--wandb-project proj --tensorboard-dir tb --num-layers 4 --hidden-size 64
--num-attention-heads 4 --group-query-attention --num-query-groups 2 --seq-length 64
--max-position-embeddings 64 --position-embedding-type rope --normalization RMSNorm
--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0
--hidden-dropout 0 --recompute-granularity full --recompute-method uniform
--no-load-optim --exit-signal-handler --eval-iters 5 --eval-interval 50 --seed 7
--adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --init-method-std 0.02
"""


def test_megatron_launch_flags_parse():
    cfg = parse_args(MEGATRON_FLAGS.split())
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.sequence_parallel and cfg.parallel.use_distributed_optimizer
    assert cfg.model.bf16 and not cfg.model.add_bias_linear and cfg.model.swiglu
    assert cfg.model.normalization == "RMSNorm" and cfg.model.num_query_groups == 2
    assert cfg.data.data_path == ["0.3", "prefixA", "0.7", "prefixB"]
    assert cfg.optim.lr == 3e-4 and cfg.optim.lr_decay_style == "cosine"
    assert cfg.checkpoint.no_load_optim and cfg.train.exit_signal_handler
    assert cfg.train.seed == 7 and cfg.optim.adam_beta2 == 0.95
    cfg.validate(8)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2


def test_unknown_flag_suggests_closest():
    with pytest.raises(ArgumentError, match="did you mean --tensor-model-parallel-size"):
        parse_args(["--tensor-model-paralel-size", "2"])
    with pytest.raises(ArgumentError, match="did you mean --micro-batch-size"):
        parse_args(["--micro-batchsize=4"])


def test_bad_values():
    with pytest.raises(ArgumentError, match="invalid float value"):
        parse_args(["--lr", "fast"])
    with pytest.raises(ArgumentError, match="invalid choice"):
        parse_args(["--normalization", "BatchNorm"])


def test_yaml_flat_and_sections_with_cli_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_layers: 6\nhidden_size: 96\nparallel:\n  tensor_model_parallel_size: 2\n"
                 "lr: 0.001\nbf16: true\n")
    cfg = parse_args(["--config", str(f), "--num-layers", "3"])
    assert cfg.model.num_layers == 3  # the command line wins
    assert cfg.model.hidden_size == 96 and cfg.model.bf16
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.optim.lr == 1e-3


def test_yaml_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_layer: 6\n")
    with pytest.raises(ArgumentError, match="unknown key 'num_layer'; did you mean num_layers"):
        parse_args(["--config", str(f)])
    with pytest.raises(ArgumentError, match="file not found"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    f.write_text("a: [1,\n")
    with pytest.raises(ArgumentError, match="not valid YAML"):
        parse_args(["--config", str(f)])


def test_every_field_has_one_flag():
    flags = [a.option_strings for a in build_parser()._actions]
    flat = [f for fs in flags for f in fs]
    assert len(flat) == len(set(flat))


def test_help_runs():
    out = subprocess.run([sys.executable, "-c", "from megalite.arguments import build_parser;"
                          "build_parser().print_help()"], capture_output=True, text=True)
    assert out.returncode == 0 and "--tensor-model-parallel-size" in out.stdout


def test_the_training_entrypoint_needs_the_models_size(tmp_path):
    """Megatron refuses to train without the model's size; so does pretrain_gpt.py (one
    line, exit 2) instead of training megalite's small default model. A --config file may
    give the sizes."""
    from megalite.arguments import MODEL_SIZE_FIELDS
    from megalite.config import ConfigError

    with pytest.raises(ConfigError, match=r"not given: --hidden-size, --num-attention-heads"):
        parse_args(["--num-layers", "2"], required=MODEL_SIZE_FIELDS)
    yaml = tmp_path / "run.yaml"
    yaml.write_text("num_layers: 2\nhidden_size: 32\nnum_attention_heads: 4\n")
    assert parse_args(["--config", str(yaml)], required=MODEL_SIZE_FIELDS).model.num_layers == 2
    assert parse_args([]).model.num_layers   # library callers keep the defaults
    out = subprocess.run([sys.executable, "pretrain/pretrain_gpt.py", "--mock-data",
                          "--train-iters", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "megalite: error: the model's size is not given: --num-layers, --hidden-size, "
        "--num-attention-heads (Megatron-LM requires them too; megalite would otherwise "
        "train its small default model)"]


def test_negated_flags_say_what_they_turn_off():
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert helps["--no-mmap-bin-files"].startswith("Turns off (on without this flag): "
                                                   "memory-mapping the .bin files")
    assert helps["--disable-bias-linear"] == ("Turns off (on without this flag): biases in "
                                              "the linear layers.")
