"""DeepSeek-V3's expert and routing flags, as Megatron-LM's configuration passes them
(``tools/megatron_flags.py``'s ``DEEPSEEK_V3_MOE``), train with only the sizes, the parallel
sizes and the paths changed: 2 layers (the first dense, as DeepSeek-V3's first three), 16
experts in 8 groups (top-8 of 4 groups, as DeepSeek-V3), expert parallel 2 on 2 ranks.
Megatron-LM refuses the script's ``--moe-shared-expert-overlap`` with the README's
``--overlap-moe-expert-parallel-comm`` (and ``--delay-wgrad-compute``, which needs it), so
the flags train twice: without the former, and without the latter two."""

import pytest

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.compat import no_effect_line
from tests.distributed.harness import run_distributed
from tests.tools import load_tool
from tests.training.common import run_training, tiny_flags

SIZES = {"--num-experts": "16", "--moe-layer-freq": "[0]*1+[1]*1",
         "--moe-ffn-hidden-size": "16", "--moe-shared-expert-intermediate-size": "16"}


BATCH_OVERLAP = ("--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute")
SHARED_OVERLAP = ("--moe-shared-expert-overlap",)


def deepseek_argv(drop=SHARED_OVERLAP) -> list[str]:
    """The configuration's flags with :data:`SIZES` substituted, those in ``drop`` left
    out, over a tiny backbone."""
    argv = []
    for flag, values in load_tool("megatron_flags").split_flags(
            load_tool("megatron_flags").DEEPSEEK_V3_MOE):
        if flag not in drop:
            argv += [flag, *([SIZES[flag]] if flag in SIZES else values)]
    return tiny_flags(**{"--train-iters": 4, "--swiglu": None, "--disable-bias-linear": None,
                         "--normalization": "RMSNorm", "--position-embedding-type": "rope",
                         "--expert-model-parallel-size": 2}) + argv


def _train(rank, world_size, argvs):
    out = []
    for argv in argvs:
        cfg = parse_args(argv)
        cfg.validate(world_size)
        result, c = run_training(cfg)
        bias = c.model.full_state_dict()["decoder.layers.1.mlp.router.expert_bias"]
        out.append((result.losses, result.moe_losses, bias, no_effect_line(cfg)))
    return out


def test_deepseek_v3_routing_flags_train():
    argvs = [deepseek_argv(SHARED_OVERLAP), deepseek_argv(BATCH_OVERLAP)]
    runs = run_distributed(2, _train, argvs)[0]
    for losses, moe, bias, line in runs:
        assert len(losses) == 4 and losses[4] < losses[1]
        assert all(m["moe_aux_loss"] > 0 and set(m["expert_load"]) == {"1"}
                   for m in moe.values())
        assert 0 < bias.abs().max() <= 4 * 1e-3 * (1 + 1e-6)   # 4 steps of the rate at most
        for flag in ("--moe-token-dispatcher-type flex", "--moe-permute-fusion",
                     "--moe-grouped-gemm"):
            assert flag in line, flag
        assert "--moe-shared-expert-overlap" not in line   # it acts
    # the shared experts' overlap changes when they run, not what they compute
    assert runs[0][0] == runs[1][0]


def test_deepseek_v3_flags_refuse_both_overlaps():
    with pytest.raises(ConfigError, match="with --moe-shared-expert-overlap is not supported"):
        parse_args(deepseek_argv(drop=())).validate(2)
