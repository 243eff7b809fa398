"""docs/megatron.md's Megatron flag table is what tools/megatron_flags.py generates from the
parser (so a stale table fails the tests)."""

import os

from tests.tools import load_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    return load_tool("megatron_flags")


def test_docs_table_is_current():
    tool = _tool()
    assert tool.main(["--check", os.path.join(REPO, "docs", "megatron.md")]) == 0, (
        "docs/megatron.md's Megatron flag table is stale: python tools/megatron_flags.py "
        "--write docs/megatron.md")


def test_check_fails_on_a_stale_table_and_write_fixes_it(tmp_path, capsys):
    tool = _tool()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{tool.BEGIN}\n| old |\n{tool.END}\nafter\n")
    assert tool.main(["--check", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert tool.main(["--write", str(readme)]) == 0
    assert tool.main(["--check", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n") and text.endswith(f"{tool.END}\nafter\n")
    # columns: Llama-3 8B, Mixtral 8x7B, GPT-3 175B, DeepSeek-V3, DeepSeek-V3 MoE,
    # Qwen3-30B-A3B, Muon and Lion
    assert "| `--no-mmap-bin-files` | ✓ |  |  | ✓ |  |  |  | accepted, no effect here: " in text
    assert "| `--tokenizer-type Llama2Tokenizer` |  | ✓ |  |  |  |  |  | implemented |" in text
    assert "| `--moe-router-enable-expert-bias` |  |  |  | ✓ | ✓ |  |  | implemented |" in text
    assert "| `--multi-latent-attention` |  |  |  | ✓ |  |  |  | implemented |" in text
    assert "| `--qk-layernorm` |  |  |  | ✓ |  | ✓ |  | implemented |" in text
    assert "| `--moe-layer-recompute` |  |  |  |  |  | ✓ |  | implemented |" in text
    assert "| `--no-rope-fusion` |  |  |  |  |  | ✓ |  | accepted, no effect here: " in text
    assert "| `--muon-tp-mode distributed` |  |  |  |  |  |  | ✓ | implemented |" in text
    assert "| `--muon-scalar-optimizer lion` |  |  |  |  |  |  | ✓ | implemented |" in text
    assert "| `--optimizer lion` |  |  |  |  |  |  | ✓ | implemented differently: " in text


def test_rows_come_from_the_parser():
    tool = _tool()
    rows = {r["flag"]: r for r in tool.rows()}
    assert rows["--tiktoken-pattern v2"]["status"] == "implemented"
    assert rows["--empty-unused-memory-level 1"]["status"] == "accepted, no effect here"
    assert tool.split_flags('--a 1 --b --c "x y" z') == [("--a", ["1"]), ("--b", []),
                                                         ("--c", ["x y", "z"])]


def test_deepseek_v3_script_refuses_nothing():
    """Megatron-LM's DeepSeek-V3 launch script runs with its sizes, parallel sizes and paths
    changed: every flag it passes is implemented or accepted, multi-token prediction
    included."""
    tool = _tool()
    refused = {r["flag"] for r in tool.rows()
               if "DeepSeek-V3" in r["scripts"] and r["status"] == "refused"}
    assert refused == set()
    rows = {r["flag"]: r for r in tool.rows()}
    for flag in ("--mtp-num-layers", "--mtp-loss-scaling-factor"):
        assert rows[flag]["status"] == "implemented", flag
    assert rows["--recompute-modules mlp moe mla_up_proj layernorm"]["status"] == "implemented"
    for flag in ("--lr-warmup-init", "--log-params-norm", "--log-num-zeros-in-grad",
                 "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                 "--logging-level"):
        assert rows[flag]["status"] == "implemented", flag
    for flag in ("--transformer-impl transformer_engine", "--use-flash-attn",
                 "--enable-experimental", "--auto-detect-ckpt-format",
                 "--dist-ckpt-strictness log_all"):
        assert rows[flag]["status"] == "accepted, no effect here", flag
