"""--no-position-embedding, Megatron's attention backend names, and the flags accepted
without effect."""

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import ConfigError
from megalite.config.fields import no_effect_settings
from megalite.models.families import family_of, get_family
from megalite.models.gpt import GPTModel
from megalite.transformer.attention_kernels import KERNELS, select_attention_backend
from tests.model.common import batch, gpt2_config, llama_config, single_process_state


def _names(cfg):
    return set(dict(GPTModel(cfg, single_process_state(), seed=1).named_parameters()))


def test_flag_parses_as_store_false():
    assert parse_args([]).model.add_position_embedding is True
    assert parse_args(["--no-position-embedding"]).model.add_position_embedding is False


def test_learned_absolute_without_table_has_no_positions():
    cfg = gpt2_config(add_position_embedding=False, max_position_embeddings=4)
    assert not cfg.learned_positions  # so the table size need not cover seq_length
    names = _names(cfg)
    assert "embedding.position_embeddings.weight" in _names(gpt2_config())
    assert "embedding.position_embeddings.weight" not in names
    model = GPTModel(cfg, single_process_state(), seed=1).eval()
    ids, _ = batch(cfg)
    with torch.no_grad():
        out = model(ids)
        # no positions and a causal mask: a token's output depends only on the prefix
        # multiset, so two equal tokens at the start give equal outputs
        same = ids.clone()
        same[:, 1] = same[:, 0]
        logits = model(same)
    assert out.shape[1] == cfg.seq_length
    assert torch.allclose(logits[:, 0], logits[:, 1], atol=1e-5)


def test_rope_is_unchanged():
    plain, flagged = llama_config(), llama_config(add_position_embedding=False)
    assert _names(plain) == _names(flagged)
    ids, labels = batch(plain)
    losses = [GPTModel(c, single_process_state(), seed=1)(ids, labels=labels)
              for c in (plain, flagged)]
    assert torch.equal(losses[0], losses[1])


def test_gpt2_converter_refuses_a_model_without_positions():
    cfg = gpt2_config(add_position_embedding=False)
    with pytest.raises(ValueError, match="no position table"):
        get_family("gpt2").hf_config(cfg)
    with pytest.raises(ValueError, match="no position table"):
        family_of(cfg)
    assert family_of(llama_config(add_position_embedding=False)).name == "llama"


@pytest.mark.parametrize("megatron, ours", [("fused", "sdpa"), ("unfused", "local")])
def test_megatron_attention_backends(megatron, ours):
    assert parse_args(["--attention-backend", megatron]).model.attention_backend == megatron
    assert select_attention_backend(megatron, torch.device("cpu"), torch.float32) == ours
    model = GPTModel(llama_config(attention_backend=megatron), single_process_state(), seed=1)
    kernel = model.decoder.layers["0"].self_attention.core_attention
    assert type(kernel) is KERNELS[ours]


def test_megatron_backends_give_the_same_loss():
    ids, labels = batch(llama_config())
    losses = [GPTModel(llama_config(attention_backend=name), single_process_state(),
                       seed=1)(ids, labels=labels) for name in ("fused", "unfused")]
    assert (losses[0] - losses[1]).abs().max().item() < 1e-5


def test_accepted_flags_are_listed_as_no_effect():
    cfg = parse_args(["--use-mcore-models", "--no-masked-softmax-fusion",
                      "--moe-grouped-gemm"]).model
    assert cfg.masked_softmax_fusion is False
    listed = dict(no_effect_settings(cfg))
    assert set(listed) == {"use_mcore_models", "masked_softmax_fusion", "moe_grouped_gemm"}
    assert "grouped GEMM" in listed["moe_grouped_gemm"]
    assert no_effect_settings(parse_args([]).model) == []


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError):
        parse_args(["--attention-backend", "te"])
