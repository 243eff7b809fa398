"""The generation server answers Megatron-style PUT /api requests and refuses bad ones
with a 400 and one line, staying up."""

import json
import threading
import urllib.error
import urllib.request

import pytest

from megalite.data.tokenizers import NullTokenizer
from megalite.inference.generation import generate
from megalite.inference.server import GenerationService, build_server
from megalite.models.gpt import GPTModel
from tests.model.common import FAMILIES, single_process_state


@pytest.fixture(scope="module")
def server():
    cfg = FAMILIES["llama"](vocab_size=51)  # NullTokenizer(50): ids 0..49 and eod 50
    model = GPTModel(cfg, single_process_state(), seed=3).eval()
    srv = build_server(GenerationService(model, NullTokenizer(50), 16), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield model, f"http://127.0.0.1:{srv.server_address[1]}/api"
    srv.shutdown()
    srv.server_close()


def _put(url, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="PUT",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_greedy_request(server):
    model, url = server
    code, out = _put(url, {"prompts": ["3 17 41", "8"], "tokens_to_generate": 5,
                           "temperature": 0})
    assert code == 200
    for prompt, ids, text in zip([[3, 17, 41], [8]], out["tokens"], out["text"]):
        want = generate(model, prompt, 5, eod=50)
        assert ids == prompt + want
        shown = prompt + (want[:-1] if want[-1:] == [50] else want)
        assert text == " ".join(map(str, shown)) and len(want) >= 1
    seeded = {"prompts": ["1 2"], "tokens_to_generate": 6, "top_k": 10, "random_seed": 7}
    assert _put(url, seeded) == _put(url, seeded)


@pytest.mark.parametrize("body, message", [
    ({"prompts": "1 2"}, "prompts must be a non-empty list of strings"),
    ({"prompts": ["1"], "tokens_to_generate": "5"}, "tokens_to_generate must be an integer"),
    ({"prompts": ["1"], "tokens_to_generate": 10**6}, "tokens_to_generate must be in"),
    ({"prompts": ["1"], "top_p": 3}, "top_p must be in [0.0, 1.0]"),
    ({"prompts": ["1"], "temperature": True}, "temperature must be a number"),
    ({"prompts": ["1"] * 33}, "at most 32 prompts"),
    ({"prompts": ["1"], "foo": 1}, "unknown fields: foo"),
    ({"prompts": [" ".join(["1"] * 20)]}, "sequence length is 16"),
    ({"prompts": ["hello"]}, "NullTokenizer reads space-separated integers"),
    (b"{not json", "not valid JSON"),
])
def test_bad_requests(server, body, message):
    _, url = server
    code, out = _put(url, body)
    assert code == 400 and message in out["error"] and "\n" not in out["error"], out
    assert _put(url, {"prompts": ["4"], "tokens_to_generate": 1})[0] == 200  # still up
