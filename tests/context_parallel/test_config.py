"""Bad context-parallel input: one clear ConfigError each, naming the values and the fix."""

import pytest

from megalite.config import ConfigError
from tests.training.common import tiny_config


def _cfg(world, model=None, **parallel):
    return tiny_config(world, model=model or {}, parallel=parallel)


def test_sequence_must_divide_into_two_chunks_per_cp_rank():
    with pytest.raises(ConfigError, match=r"seq_length \(20\) must be divisible by 2 x "
                                          r"context_parallel_size \(4\)"):
        _cfg(4, model={"seq_length": 20}, context_parallel_size=4)
    _cfg(4, model={"seq_length": 24}, context_parallel_size=4)   # 24 = 3 x 2 x 4


def test_a2a_needs_heads_and_groups_divisible_by_cp():
    gqa = {"group_query_attention": True, "num_query_groups": 2, "cp_comm_type": "a2a"}
    with pytest.raises(ConfigError, match=r"a2a needs num_query_groups \(2\) divisible by "
                                          r"tensor_model_parallel_size \(1\) x "
                                          r"context_parallel_size \(4\); use --cp-comm-type"):
        _cfg(4, model=gqa, context_parallel_size=4)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) divisible by "
                                          r"tensor_model_parallel_size \(2\) x "
                                          r"context_parallel_size \(4\)"):
        _cfg(8, model={"cp_comm_type": "a2a"}, context_parallel_size=4,
             tensor_model_parallel_size=2)
    _cfg(4, model=gqa, context_parallel_size=2)                  # 4 heads, 2 groups / 2
    _cfg(4, model={**gqa, "cp_comm_type": "p2p"}, context_parallel_size=4)   # ring: any


def test_hierarchical_a2a_p2p_is_refused_clearly():
    with pytest.raises(ConfigError, match=r"a2a\+p2p .* is not supported; use p2p, "
                                          r"allgather or a2a"):
        _cfg(2, model={"cp_comm_type": "a2a+p2p"}, context_parallel_size=2)


def test_cp_comm_type_flag_parses_with_megatron_name():
    from megalite.arguments import parse_args

    cfg = parse_args(["--context-parallel-size", "2", "--cp-comm-type", "allgather",
                      "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                      "4", "--seq-length", "16", "--mock-data", "--tokenizer-type",
                      "NullTokenizer", "--vocab-size", "60", "--train-iters", "1",
                      "--micro-batch-size", "1"])
    assert (cfg.parallel.context_parallel_size, cfg.model.cp_comm_type) == (2, "allgather")
    assert tiny_config().model.cp_comm_type == "p2p"             # Megatron's default
