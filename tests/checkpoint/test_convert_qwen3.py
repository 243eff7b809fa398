"""Qwen3 / Qwen3-MoE through ``tools/convert_checkpoint.py`` against the real
``transformers``: a tiny random model saved with a byte-level BPE tokenizer converts to
megalite carrying its tokenizer, and the converted checkpoint loaded at tp 2, pp 2 and
(Qwen3-MoE) ep 2 gives transformers' fp32 logits within 1e-5 and its greedy tokens token
for token; megalite -> HF gives back the source's files bit for bit, with a tokenizer
``AutoTokenizer`` reads."""

import os
from argparse import Namespace

import pytest
import torch

from megalite.checkpoint.tokenizer_dir import carried_tokenizer
from megalite.inference.generation import generate
from megalite.inference.loading import load_for_inference, load_model
from tests.checkpoint.test_convert import assert_same_export, convert
from tests.checkpoint.test_tokenizer_travel import TEXTS, _bpe
from tests.distributed.harness import parallel_state, run_distributed
from tests.inference.common import sequence_logits
from tests.model.test_qwen3_parity import PROMPT, hf_model

TOL = 1e-5
FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}  # family -> case of hf_model
TOKENS = [5, 12, 44, 0, 7, 33, 21, 19, 48, 2, 10, 27]
# (name, ParallelConfig sizes) of the 2-rank layouts each family loads at
LAYOUTS = {"qwen3": [("tp2", {"tensor_model_parallel_size": 2}),
                     ("pp2", {"pipeline_model_parallel_size": 2})],
           "qwen3_moe": [("tp2", {"tensor_model_parallel_size": 2}),
                         ("pp2", {"pipeline_model_parallel_size": 2}),
                         ("ep2", {"tensor_model_parallel_size": 2,
                                  "expert_model_parallel_size": 2,
                                  "expert_tensor_parallel_size": 1})]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{family: (HF directory, HF model, greedy tokens, logits [s, V])}: saved with a
    Qwen-style tokenizer (byte-level BPE, ``<|endoftext|>`` ends documents)."""
    from transformers import PreTrainedTokenizerFast

    out = {}
    for family, case in FAMILIES.items():
        src = str(tmp_path_factory.mktemp(family) / "hf")
        tok = PreTrainedTokenizerFast(
            tokenizer_object=_bpe(300, byte_level=True,
                                  specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")),
            eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        tok.save_pretrained(src)
        model = hf_model(case, vocab_size=len(tok))
        model.config.eos_token_id = model.config.pad_token_id = tok.eos_token_id
        model.save_pretrained(src)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=12,
                                    do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(PROMPT):].tolist()
            logits = model(torch.tensor([TOKENS])).logits[0]
        out[family] = (src, model, greedy, logits)
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """{family: (megalite checkpoint directory, the converter's printed output)}."""
    import contextlib
    import io

    out = {}
    for family, (src, *_rest) in sources.items():
        save = str(tmp_path_factory.mktemp(family) / "megalite")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            convert("--source", "hf", "--target", "megalite", "--load-dir", src,
                    "--save-dir", save)
        out[family] = (save, printed.getvalue())
    return out


def test_conversion_prints_the_flags_and_carries_the_tokenizer(sources, converted):
    from transformers import AutoTokenizer

    for family, (save, printed) in converted.items():
        assert f"({family}," in printed and "--qk-layernorm" in printed, printed
        if family == "qwen3_moe":
            assert "--num-experts 4 --moe-router-topk 2" in printed
            assert "--moe-layer-freq '[0]*1+[1]*3'" in printed
            assert "--moe-router-pre-softmax" not in printed  # norm_topk_prob=True
        assert carried_tokenizer(save) == os.path.join(save, "tokenizer")
        _, _, tokenizer = load_for_inference(save, args=Namespace(
            tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None))
        ref = AutoTokenizer.from_pretrained(sources[family][0], local_files_only=True)
        for text in TEXTS:
            assert tokenizer.tokenize(text) == ref(text)["input_ids"]
        assert tokenizer.eod == ref.eos_token_id


def test_one_process_matches_transformers(sources, converted):
    for family, (save, _) in converted.items():
        _, model = load_model(save)
        _, _, greedy, logits = sources[family]
        assert generate(model, PROMPT, 12) == greedy and len(set(greedy)) > 1
        got = sequence_logits(model, TOKENS, use_cache=False)
        assert (got - logits).abs().max().item() < TOL


def _layouts_body(rank, world_size, cases):
    out = {}
    for family, (save, layouts) in cases.items():
        for name, sizes in layouts:
            with parallel_state(**sizes) as ps:
                _, model = load_model(save, None, ps)
                out[family, name] = (generate(model, PROMPT, 12),
                                     sequence_logits(model, TOKENS, use_cache=False),
                                     sequence_logits(model, TOKENS, use_cache=True),
                                     sorted(int(i) for i in model.decoder.layers))
    return out


def test_tp2_pp2_ep2_after_conversion_match_transformers(sources, converted):
    cases = {family: (converted[family][0], LAYOUTS[family]) for family in FAMILIES}
    ranks = run_distributed(2, _layouts_body, cases)
    for rank, results in enumerate(ranks):
        for (family, name), (tokens, full, cached, layers) in results.items():
            _, hf, greedy, logits = sources[family]
            assert tokens == greedy, (family, name, rank)
            assert (full - logits).abs().max().item() < TOL, (family, name, rank)
            assert (cached - logits).abs().max().item() < TOL, (family, name, rank)
            n = hf.config.num_hidden_layers
            want = list(range(n)) if name != "pp2" else \
                list(range(rank * n // 2, (rank + 1) * n // 2))
            assert layers == want, (family, name, rank)


def test_export_gives_back_the_source(sources, converted, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for family, (save, _) in converted.items():
        src, hf, _, logits = sources[family]
        out = str(tmp_path / family)
        convert("--source", "megalite", "--target", "hf", "--load-dir", save, "--save-dir", out)
        assert_same_export(src, out)
        again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        assert type(again) is type(hf)
        for key in ("num_experts", "num_experts_per_tok", "norm_topk_prob",
                    "moe_intermediate_size", "intermediate_size", "tie_word_embeddings",
                    "eos_token_id"):
            assert getattr(again.config, key, None) == getattr(hf.config, key, None), key
        with torch.no_grad():
            assert (again(torch.tensor([TOKENS])).logits[0] - logits).abs().max() < TOL
        ref = AutoTokenizer.from_pretrained(src, local_files_only=True)
        exported = AutoTokenizer.from_pretrained(out, local_files_only=True)
        for text in TEXTS:
            assert exported(text)["input_ids"] == ref(text)["input_ids"]


def test_generate_tool_needs_no_tokenizer_flags(sources, converted, capsys):
    """tools/generate.py on the converted Qwen3-MoE, with and without naming the tokenizer:
    the same text."""
    from tests.tools import load_tool

    save, src = converted["qwen3_moe"][0], sources["qwen3_moe"][0]
    outputs = []
    for extra in ([], ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", src]):
        assert load_tool("generate").main(["--load", save, "--prompt", TEXTS[0],
                                           "--max-new-tokens", "5", "--temperature", "0",
                                           *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith(f"[{TEXTS[0]}]")


@pytest.mark.parametrize("family, model", [
    ("qwen3", {"untie_embeddings_and_output_weights": False}),
    ("qwen3_moe", {"num_layers": 3, "num_experts": 4, "moe_router_topk": 2,
                   "moe_ffn_hidden_size": 16, "moe_layer_freq": "[1]+[0]+[1]",
                   "moe_router_pre_softmax": True}),
])
def test_trained_checkpoint_in_transformers_gives_our_logits(tmp_path, family, model):
    """Trained here (3 iterations; Qwen3 tied, Qwen3-MoE with a dense middle layer and
    un-renormalized top-k), exported: ``AutoModelForCausalLM`` gives our logits."""
    from transformers import AutoModelForCausalLM

    from megalite.checkpoint.consolidated import load_full_model
    from megalite.models.families import get_family
    from tests.training.common import run_training, tiny_config

    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    sizes = {"group_query_attention": True, "num_query_groups": 2, "kv_channels": 16,
             "ffn_hidden_size": 48}
    run_training(tiny_config(model={**get_family(family).defaults, **sizes, **model},
                             train={"train_iters": 3}, checkpoint={"save": save}))
    convert("--source", "megalite", "--target", "hf", "--load-dir", save, "--save-dir", out)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf.config.model_type == family
    if family == "qwen3_moe":
        assert hf.config.mlp_only_layers == [1] and hf.config.norm_topk_prob is False
    _, ours = load_full_model(save)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.eval()(ids)[..., :61]
    assert (got - want).abs().max().item() < TOL
