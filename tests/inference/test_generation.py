"""Generation: greedy output equals transformers' generate() token for token; the KV
cache gives the same logits as full forwards; sampling filters keep the right tokens."""

import pytest
import torch

from megalite.inference.generation import GenerationError, generate, generate_batch
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.sampling import SamplingError, SamplingParams, filter_logits, sample
from megalite.models.families import get_family
from megalite.models.gpt import GPTModel
from tests.inference.common import sequence_logits
from tests.model.common import FAMILIES, mixtral_config, single_process_state
from tests.model.test_hf_parity import _random_weights

PROMPT = [3, 17, 41, 8, 29]
CONFIGS = {**FAMILIES, "mixtral": mixtral_config}  # GPT-2, Llama, Mixtral (MoE)


def _pair(family):
    """(our model, the HF model) holding the same random weights."""
    import transformers

    spec, cfg = get_family(family), CONFIGS[family]()
    ours = GPTModel(cfg, single_process_state(), seed=1).eval()
    state = _random_weights(ours)
    ours.load_full_state_dict(state)
    hcfg = spec.hf_config(cfg)
    hcfg._attn_implementation = "eager"
    hf = getattr(transformers, spec.hf_architecture)(hcfg).eval()
    result = hf.load_state_dict(spec.to_hf(state, cfg), strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    return ours, hf


@pytest.fixture(scope="module")
def models():
    return {family: _pair(family) for family in CONFIGS}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_matches_transformers_generate(models, family):
    import transformers

    ours, hf = models[family]
    new = ours.config.seq_length - len(PROMPT)  # up to the full sequence length
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), generation_config=config)[0, len(PROMPT):]
    got = generate(ours, PROMPT, new)
    assert len(got) == new == 11
    assert got == want.tolist()
    assert generate(ours, PROMPT, new, use_cache=False) == got
    assert len(set(got)) > 1  # not a degenerate constant output


@pytest.mark.parametrize("family", list(CONFIGS))
def test_kv_cache_logits_match_full_forward(models, family):
    ours, _ = models[family]
    tokens = PROMPT + [11, 2, 45, 19, 33, 7, 0, 49, 12, 26, 5]
    full = sequence_logits(ours, tokens, use_cache=False)
    stepped = sequence_logits(ours, tokens, use_cache=True)
    assert full.shape == stepped.shape == (16, 50)
    assert (full - stepped).abs().max().item() < 1e-4
    # a prefill of 6 tokens, then chunks of 4 and 1: the cache offsets positions
    cache = InferenceCache(len(tokens))
    with torch.no_grad():
        a = ours(torch.tensor([tokens[:6]]), inference_cache=cache)[0, :, :50]
        b = ours(torch.tensor([tokens[6:10]]), inference_cache=cache)[0, :, :50]
        c = ours(torch.tensor([tokens[10:11]]), inference_cache=cache)[0, :, :50]
    assert cache.seq_len == 11
    assert (torch.cat([a, b, c]) - full[:11]).abs().max().item() < 1e-4


def test_eod_stops_and_limits(models):
    ours, _ = models["llama"]
    greedy = generate(ours, PROMPT, 6)
    stop = greedy[2]
    first = greedy.index(stop)
    assert generate(ours, PROMPT, 6, eod=stop) == greedy[:first + 1]
    with pytest.raises(GenerationError, match="sequence length is 16"):
        generate(ours, list(range(16)), 4)
    with pytest.raises(GenerationError, match="outside the model's vocabulary of 50"):
        generate(ours, [1, 2, 50], 4)
    with pytest.raises(GenerationError, match="empty"):
        generate(ours, [], 4)


def test_sampling_is_seeded_and_filters(models):
    ours, _ = models["gpt2"]
    params = SamplingParams(temperature=1.0, top_k=5)
    a = generate(ours, PROMPT, 8, params, generator=torch.Generator().manual_seed(3))
    b = generate(ours, PROMPT, 8, params, generator=torch.Generator().manual_seed(3))
    assert a == b and len(a) == 8
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [
        [False, True, False, True, False]]
    # probabilities 0.64, 0.24, 0.09, ...: top-p 0.7 keeps the first two, 0.5 only one
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [
        [False, True, False, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [
        [False, True, False, False, False]]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(1.0, top_k=2), g)) for _ in range(200)}
    assert draws == {1, 3}
    assert sample(logits, SamplingParams(temperature=0.0)).tolist() == [1]
    with pytest.raises(SamplingError, match="top-p"):
        SamplingParams(top_p=1.5).check()


BATCH = [PROMPT, [9], [22, 4, 31], list(range(1, 15)), [7, 7]]  # lengths 5, 1, 3, 14, 2


@pytest.mark.parametrize("family", list(CONFIGS))
def test_batch_equals_one_at_a_time(models, family):
    """Left-padded batches (pad keys masked, positions per row) give each prompt's greedy
    tokens of generating it alone; each row stops on its own (the 14-token prompt at the
    sequence length of 16, others at their eod)."""
    ours, _ = models[family]
    alone = [generate(ours, p, 8) for p in BATCH]
    assert [len(a) for a in alone] == [8, 8, 8, 2, 8]
    assert generate_batch(ours, BATCH, 8) == alone
    assert generate_batch(ours, BATCH, 8, use_cache=False) == alone
    eod = alone[0][3]  # a token some rows draw: those rows stop there, the others go on
    want = [generate(ours, p, 8, eod=eod) for p in BATCH]
    assert generate_batch(ours, BATCH, 8, eod=eod, pad_id=eod) == want
    assert any(len(w) < len(a) for w, a in zip(want, alone))
    # the padded rows' logits equal their own unpadded forward
    cache = InferenceCache(14, pad_lengths=torch.tensor([9, 0]))
    ids = torch.tensor([[0] * 9 + PROMPT, list(range(1, 15))])
    with torch.no_grad():
        got = ours(ids, position_ids=cache.position_ids(2, 14), inference_cache=cache)
    full = sequence_logits(ours, PROMPT, use_cache=False)
    assert (got[0, 9:, :50].float() - full).abs().max().item() < 1e-4
