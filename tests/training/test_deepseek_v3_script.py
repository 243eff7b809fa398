"""Megatron-LM's DeepSeek-V3 launch script (``tools/megatron_flags.py``'s ``DEEPSEEK_V3``,
from examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh) trains here with only the sizes,
the parallel sizes and the paths changed: 2 layers (the first dense), 16 experts in 8
groups, multi-latent attention, expert parallel 2 on 2 ranks, a tiny HuggingFace tokenizer
file for DeepSeek-V3's, mock data for ``--data-path``; with its multi-token prediction
(``--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1``), whose depth's loss is logged."""

import os

from megalite.arguments import parse_args
from megalite.compat import no_effect_line
from tests.distributed.harness import run_distributed
from tests.training.common import megatron_script_argv, read_jsonl, run_training

LEFT_OUT = {"--data-path"}


def _sizes(tmp: str) -> dict:
    return {
        "--expert-model-parallel-size": "2", "--micro-batch-size": "1",
        "--global-batch-size": "4", "--train-samples": "16", "--num-workers": "0",
        "--seq-length": "32", "--max-position-embeddings": "32", "--num-layers": "2",
        "--hidden-size": "64", "--ffn-hidden-size": "64", "--num-attention-heads": "4",
        "--kv-channels": "16", "--make-vocab-size-divisible-by": "16",
        "--lr-decay-samples": "16", "--lr-warmup-samples": "8",
        "--num-experts": "16", "--moe-layer-freq": "[0]*1+[1]*1",
        "--moe-ffn-hidden-size": "16", "--moe-shared-expert-intermediate-size": "16",
        "--q-lora-rank": "16", "--kv-lora-rank": "16", "--qk-head-dim": "8",
        "--qk-pos-emb-head-dim": "4", "--v-head-dim": "8", "--eval-iters": "1",
        "--eval-interval": "2", "--save-interval": "2",
        "--data-cache-path": os.path.join(tmp, "cache"),
        "--tokenizer-model": os.path.join(tmp, "tokenizer.json"),
        "--load": os.path.join(tmp, "ckpt"), "--save": os.path.join(tmp, "ckpt"),
        "--tensorboard-dir": os.path.join(tmp, "tb"),
    }


def _argv(tmp: str) -> list[str]:
    return ["--mock-data", "--metrics-jsonl", os.path.join(tmp, "m.jsonl"),
            *megatron_script_argv("DEEPSEEK_V3", _sizes(tmp), skip=LEFT_OUT)]


def _train(rank, world_size, argv):
    cfg = parse_args(argv)
    cfg.validate(world_size)
    result, _ = run_training(cfg)
    return result.losses, result.valid_losses, no_effect_line(cfg)


def test_deepseek_v3_script_trains(tmp_path):
    from tests.data.test_tokenizers import _tiny_hf_tokenizer

    _tiny_hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    losses, valid, line = run_distributed(2, _train, _argv(str(tmp_path)))[0]
    assert sorted(losses) == [1, 2, 3, 4] and sorted(valid) == [2, 4]
    rows = read_jsonl(str(tmp_path / "m.jsonl"))
    assert all(r["params_norm"] > 0 and r["num_zeros"] >= 0 for r in rows)
    assert all(r["mtp_1_loss"] > 0 for r in rows) and "mtp_2_loss" not in rows[0]
    assert rows[0]["lr"] == 3.9e-7          # --lr-warmup-init: the warm-up starts there
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000004")
    for flag in ("--transformer-impl transformer_engine", "--use-flash-attn",
                 "--enable-experimental", "--auto-detect-ckpt-format",
                 "--dist-ckpt-strictness log_all"):
        assert flag in line, flag
