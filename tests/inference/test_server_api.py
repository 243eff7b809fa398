"""The generation server answers Megatron-LM's /api fields as Megatron's server does:
logprobs (a prompt scored with tokens_to_generate 0 equals the model's own log-softmax),
top_n_logprobs, segments, add_BOS, stop_token, stop_on_eol / stop_on_double_eol,
prevent_newline_after_colon, no_log and its log line; beam search is refused; the new
fields are checked with a 400; at tp 2 and pp 2 the answers equal one process's. A real
HTTP client against servers on 127.0.0.1, ports the OS chose."""

import threading

import pytest
import torch

from megalite.data.tokenizers import NullTokenizer
from megalite.inference.generation import generate, max_sequence_length
from megalite.inference.server import GenerationService, ServerLimits, build_server, follow
from megalite.models.gpt import GPTModel
from tests.distributed.harness import run_distributed
from tests.inference.common import put_json
from tests.model.common import FAMILIES, single_process_state


class CharTokenizer:
    """One token per character of CHARS, then bos and eod."""

    CHARS = "\n :abcdefgh"

    def __init__(self):
        self.bos, self.eod = len(self.CHARS), len(self.CHARS) + 1
        self.vocab_size = self.pad = len(self.CHARS) + 2

    def tokenize(self, text):
        return [self.CHARS.index(c) for c in text]

    def detokenize(self, ids):
        return "".join(self.CHARS[i] if i < len(self.CHARS) else "" for i in ids)


def _serve(service):
    srv = build_server(service, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/api"


def _put(url, body):
    return put_json(url, body)


@pytest.fixture(scope="module")
def null_server():
    """A Llama-style model over NullTokenizer(50): ids 0..49, eod 50, 16 positions."""
    model = GPTModel(FAMILIES["llama"](vocab_size=51), single_process_state(), seed=3).eval()
    lines = []
    service = GenerationService(model, NullTokenizer(50), 16,
                                ServerLimits(max_prompts=4, max_tokens_to_generate=8),
                                log=lines.append)
    srv, url = _serve(service)
    yield model, url, lines
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def char_server():
    """A model over CharTokenizer that, given the chance, always draws a newline (+100
    on its logit)."""
    tok = CharTokenizer()
    model = GPTModel(FAMILIES["llama"](vocab_size=tok.vocab_size), single_process_state(),
                     seed=5).eval()

    def favour_newline(module, args, out):
        out = out.clone()
        out[..., 0] += 100.0
        return out

    model.register_forward_hook(favour_newline)
    srv, url = _serve(GenerationService(model, tok, 16, log=lambda line: None))
    yield url
    srv.shutdown()
    srv.server_close()


def _direct_logprobs(model, ids):
    """fp32 [len(ids), 51]: the model's log-softmax at each position, one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float()[:, :51]
    return torch.log_softmax(logits, dim=-1)


PROMPTS = [[3, 17, 41, 8, 29, 12], [9, 4], [22, 4, 31, 40, 2, 11, 6, 1, 30, 7, 7, 7, 1, 2, 3,
                                           4]]


def test_scoring_logprobs_equal_the_models_log_softmax(null_server):
    """tokens_to_generate 0 with logprobs: one float per token after the first, the
    model's log-probability of it (a batch of three lengths, one filling the sequence)."""
    model, url, _ = null_server
    code, out = _put(url, {"prompts": [" ".join(map(str, p)) for p in PROMPTS],
                           "tokens_to_generate": 0, "logprobs": True})
    assert code == 200 and out["tokens"] == PROMPTS and "top_n_logprobs" not in out
    for ids, got in zip(PROMPTS, out["logprobs"]):
        want = _direct_logprobs(model, ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert len(got) == len(ids) - 1
        assert torch.allclose(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_generated_logprobs_and_top_n(null_server):
    """Greedy generation with logprobs and top_n_logprobs 3: logprobs of the prompt and
    the new tokens equal a plain forward of the whole row; each position has 3 entries,
    most likely first, the first being the greedy token wherever a token was generated."""
    model, url, _ = null_server
    code, out = _put(url, {"prompts": ["3 17 41", "8"], "tokens_to_generate": 5,
                           "temperature": 0, "logprobs": True, "top_n_logprobs": 3})
    assert code == 200
    for prompt, row, lp, top in zip([[3, 17, 41], [8]], out["tokens"], out["logprobs"],
                                    out["top_n_logprobs"]):
        assert row == prompt + generate(model, prompt, 5, eod=50)
        assert len(lp) == len(top) == len(row) - 1
        direct = _direct_logprobs(model, row)
        want = direct[torch.arange(len(row) - 1), torch.tensor(row[1:])]
        assert torch.allclose(torch.tensor(lp), want, atol=1e-5, rtol=0)
        for j, entry in enumerate(top):
            values = list(entry.values())
            assert len(entry) == 3 and values == sorted(values, reverse=True)
            best = torch.topk(direct[j], 3)
            assert list(entry) == [str(i) for i in best.indices.tolist()]
            assert torch.allclose(torch.tensor(values), best.values, atol=1e-5, rtol=0)
            if j >= len(prompt) - 1:   # a generated (greedy) token
                assert list(entry)[0] == str(row[j + 1])
                assert entry[str(row[j + 1])] == pytest.approx(lp[j], abs=1e-6)


def test_segments_join_to_the_text(null_server):
    _, url, _ = null_server
    code, out = _put(url, {"prompts": ["3 17 41", "8"], "tokens_to_generate": 6,
                           "random_seed": 3})
    assert code == 200
    for text, segments, tokens in zip(out["text"], out["segments"], out["tokens"]):
        assert len(segments) == len(tokens) and "".join(segments) == text
        assert segments[:3] in (["3", " 17", " 41"], ["8", f" {tokens[1]}", f" {tokens[2]}"])
        if tokens[-1] == 50:   # the end-of-document is not in the text
            assert segments[-1] == ""


def test_add_bos_and_stop_token(null_server):
    model, url, _ = null_server
    code, out = _put(url, {"prompts": ["3 17", ""], "tokens_to_generate": 0,
                           "add_BOS": True, "logprobs": True})
    assert code == 200 and out["tokens"] == [[50, 3, 17], [50]]   # no bos: the eod
    assert [len(lp) for lp in out["logprobs"]] == [2, 0]
    free = generate(model, [3, 17, 41], 8, eod=50)
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != 50)
    code, out = _put(url, {"prompts": ["3 17 41"], "tokens_to_generate": 8,
                           "temperature": 0, "stop_token": free[k]})
    assert code == 200 and out["tokens"][0] == [3, 17, 41] + free[:k + 1]


def test_bos_of_the_tokenizer_eol_stops_and_newline_after_colon(char_server):
    url = char_server
    tokens = _put(url, {"prompts": ["ab"], "tokens_to_generate": 3, "add_BOS": True,
                        "temperature": 0})[1]["tokens"][0]
    assert tokens == [11, 3, 4, 0, 0, 0]   # bos, "a", "b", then newlines
    assert _put(url, {"prompts": ["ab"], "tokens_to_generate": 5, "temperature": 0,
                      "stop_on_eol": True})[1]["text"] == ["ab\n"]
    assert _put(url, {"prompts": ["ab"], "tokens_to_generate": 5, "temperature": 0,
                      "stop_on_double_eol": True})[1]["text"] == ["ab\n\n"]
    plain = _put(url, {"prompts": ["ab:", "a"], "tokens_to_generate": 3,
                       "temperature": 0})[1]["text"]
    assert plain == ["ab:\n\n\n", "a\n\n\n"]
    kept = _put(url, {"prompts": ["ab:", "a"], "tokens_to_generate": 3, "temperature": 0,
                      "prevent_newline_after_colon": True})[1]["tokens"]
    assert kept[0][3] != 0 and kept[0][4:] == [0, 0] and kept[1] == [3, 0, 0, 0]


def test_one_log_line_per_request_unless_no_log(null_server):
    _, url, lines = null_server
    lines.clear()
    assert _put(url, {"prompts": ["1 2", "3"], "tokens_to_generate": 4,
                      "temperature": 0})[0] == 200
    assert _put(url, {"prompts": ["1"], "tokens_to_generate": 2, "no_log": True})[0] == 200
    assert _put(url, {"prompts": ["1"], "top_n_logprobs": 99})[0] == 400
    assert len(lines) == 2, lines
    generated = len(generate(null_server[0], [1, 2], 4, eod=50)) + len(
        generate(null_server[0], [3], 4, eod=50))
    assert (f"PUT /api 200 from 127.0.0.1: 2 prompts, {generated} tokens generated, "
            in lines[0] and lines[0].endswith(" s"))
    assert "PUT /api 400 from 127.0.0.1: error: top_n_logprobs must be in [0, 20]" in lines[1]


@pytest.mark.parametrize("body, message", [
    ({"beam_width": 2}, "beam search (beam_width) is not implemented"),
    ({"beam_width": 2, "length_penalty": 1.0}, "beam search (beam_width, length_penalty)"),
    ({"length_penalty": 1.0}, "beam search (length_penalty) is not implemented"),
    ({"logprobs": "yes"}, 'logprobs must be true or false, got "yes"'),
    ({"add_BOS": 1}, "add_BOS must be true or false, got 1"),
    ({"no_log": None}, "no_log must be true or false, got null"),
    ({"stop_on_eol": "true"}, "stop_on_eol must be true or false"),
    ({"stop_on_double_eol": 0}, "stop_on_double_eol must be true or false"),
    ({"prevent_newline_after_colon": []}, "prevent_newline_after_colon must be true or false"),
    ({"top_n_logprobs": 21}, "top_n_logprobs must be in [0, 20], got 21"),
    ({"top_n_logprobs": 1.5}, "top_n_logprobs must be an integer, got 1.5"),
    ({"top_n_logprobs": True}, "top_n_logprobs must be an integer, got true"),
    ({"stop_token": -1}, "stop_token must be in [0, 2147483647], got -1"),
    ({"stop_token": "50"}, "stop_token must be an integer"),
    ({"stop_token": 51}, "stop_token must be a token id in [0, 51), got 51"),
    ({"stop_on_eol": True}, "stop_on_eol: the tokenizer has no single token for '\\n'"),
    ({"prevent_newline_after_colon": True}, "prevent_newline_after_colon: the tokenizer has "
                                            "no single token for '\\n'"),
    ({"prompts": ["1", ""]}, "prompts[1] has no tokens; an empty prompt needs add_BOS true"),
])
def test_bad_fields_are_one_line_400s(null_server, body, message):
    _, url, _ = null_server
    code, out = _put(url, {"prompts": ["1 2"], **body})
    assert code == 400 and message in out["error"] and "\n" not in out["error"], out
    assert _put(url, {"prompts": ["4"], "tokens_to_generate": 1})[0] == 200


BODIES = [
    {"prompts": ["3 17 41 8 29", "9", "22 4 31 40 2 11 6 1 30"], "tokens_to_generate": 0,
     "logprobs": True, "top_n_logprobs": 3},
    {"prompts": ["3 17 41", "9 1"], "tokens_to_generate": 6, "temperature": 0,
     "logprobs": True, "top_n_logprobs": 2, "add_BOS": True, "stop_token": 48},
    {"prompts": ["5 6", "7"], "tokens_to_generate": 5, "top_k": 10, "random_seed": 11,
     "logprobs": True},
]


def _answers(model, world: int, rank: int = 0):
    """The answers to BODIES of a server over ``model`` (rank 0 of ``world``)."""
    if rank != 0:
        follow(model)
        return None
    service = GenerationService(model, NullTokenizer(49), max_sequence_length(model.config),
                                ranks=world, log=lambda line: None)
    srv, url = _serve(service)
    try:
        return [_put(url, body) for body in BODIES]
    finally:
        srv.shutdown()
        srv.server_close()
        service.stop()


def _on_rank(rank, world_size, root, tp, pp):
    from megalite.inference.loading import inference_state, load_model

    _, model = load_model(root, None, inference_state(tp, pp))
    return _answers(model, world_size, rank)


def _close(a, b):
    """Answers equal, log-probs within 1e-4."""
    assert a.keys() == b.keys()
    for key in ("text", "segments", "tokens"):
        assert a[key] == b[key]
    for x, y in zip(a.get("logprobs", []), b.get("logprobs", [])):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
    for x, y in zip(a.get("top_n_logprobs", []), b.get("top_n_logprobs", [])):
        assert [list(d) for d in x] == [list(d) for d in y]
        assert torch.allclose(torch.tensor([list(d.values()) for d in x]),
                              torch.tensor([list(d.values()) for d in y]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_multi_rank_answers_equal_one_process(saved, tp, pp):
    """The new fields travel with each request to the other ranks; their answers equal one
    process's on the same checkpoint."""
    from megalite.inference.loading import load_model

    _, model = load_model(saved["llama"])
    one = _answers(model, 1)
    ranks = run_distributed(2, _on_rank, saved["llama"], tp, pp)
    assert ranks[1] is None and [code for code, _ in one] == [200] * len(BODIES)
    for (code, mine), (_, theirs) in zip(ranks[0], one):
        assert code == 200
        _close(mine, theirs)
    assert one[1][1]["tokens"][0][0] == 49 and len(one[0][1]["logprobs"][1]) == 0
