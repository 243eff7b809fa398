"""The generation server answers Megatron-style PUT /api requests (a request's prompts in
one batch) and refuses bad ones with a 4xx and one line, staying up; its limits (body
size, prompts, tokens, concurrent requests) hold. A real HTTP client against a server on
a port the OS chose."""

import http.client
import json
import threading
import urllib.error
import urllib.request

import pytest

from megalite.data.tokenizers import NullTokenizer
from megalite.inference.generation import generate
from megalite.inference.server import GenerationService, ServerLimits, build_server
from megalite.models.gpt import GPTModel
from tests.model.common import FAMILIES, single_process_state


@pytest.fixture(scope="module")
def server():
    cfg = FAMILIES["llama"](vocab_size=51)  # NullTokenizer(50): ids 0..49 and eod 50
    model = GPTModel(cfg, single_process_state(), seed=3).eval()
    limits = ServerLimits(max_request_bytes=2000, max_prompts=4, max_tokens_to_generate=8,
                          max_concurrent_requests=1)
    service = GenerationService(model, NullTokenizer(50), 16, limits)
    srv = build_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield model, f"http://127.0.0.1:{srv.server_address[1]}/api", service
    srv.shutdown()
    srv.server_close()


def _put(url, body, method="PUT"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_greedy_request(server):
    model, url, _ = server
    code, out = _put(url, {"prompts": ["3 17 41", "8", "1 2 3 4 5 6 7 8"],
                           "tokens_to_generate": 5, "temperature": 0})
    assert code == 200 and len(out["tokens"]) == 3
    for prompt, ids, text in zip([[3, 17, 41], [8], list(range(1, 9))], out["tokens"],
                                 out["text"]):
        want = generate(model, prompt, 5, eod=50)
        assert ids == prompt + want
        shown = prompt + (want[:-1] if want[-1:] == [50] else want)
        assert text == " ".join(map(str, shown)) and len(want) >= 1
    seeded = {"prompts": ["1 2"], "tokens_to_generate": 6, "top_k": 10, "random_seed": 7}
    assert _put(url, seeded) == _put(url, seeded)


@pytest.mark.parametrize("body, code, message", [
    ({"prompts": "1 2"}, 400, "prompts must be a non-empty list of strings"),
    ({"prompts": []}, 400, "prompts must be a non-empty list of strings"),
    ({"prompts": [1, 2]}, 400, "prompts must be a non-empty list of strings"),
    ({"prompts": ["1"], "tokens_to_generate": "5"}, 400, "tokens_to_generate must be an "
                                                         "integer"),
    ({"prompts": ["1"], "tokens_to_generate": 2.5}, 400, "tokens_to_generate must be an "
                                                         "integer"),
    ({"prompts": ["1"], "tokens_to_generate": 9}, 400, "tokens_to_generate must be in [0, 8]"),
    ({"prompts": ["1"], "tokens_to_generate": -1}, 400, "tokens_to_generate must be in"),
    ({"prompts": ["1"], "top_p": 3}, 400, "top_p must be in [0.0, 1.0]"),
    ({"prompts": ["1"], "top_k": None}, 400, "top_k must be an integer, got null"),
    ({"prompts": ["1"], "temperature": True}, 400, "temperature must be a number"),
    ({"prompts": ["1"], "random_seed": "x"}, 400, "random_seed must be an integer"),
    ({"prompts": ["1"] * 5}, 400, "at most 4 prompts per request, got 5"),
    ({"prompts": ["1"], "foo": 1}, 400, "unknown fields: foo"),
    ([1, 2], 400, "the request body must be a JSON object"),
    ({"prompts": [" ".join(["1"] * 16)], "tokens_to_generate": 0}, 400,
     "sequence length is 16"),
    ({"prompts": ["1", " ".join(["1"] * 12)], "tokens_to_generate": 5}, 400,
     "prompts[1] has 12 tokens; with tokens_to_generate 5 that is beyond the model's "
     "sequence length of 16"),
    ({"prompts": ["hello"]}, 400, "NullTokenizer reads space-separated integers"),
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b"", 400, "the body is empty"),
    (json.dumps({"prompts": ["1" * 1990]}).encode(), 413,
     "the body has 2007 bytes; at most 2000 (--max-request-bytes)"),
    (b"x" * 300_000, 413, "the body has 300000 bytes; at most 2000"),
])
def test_bad_requests(server, body, code, message):
    _, url, _ = server
    got, out = _put(url, body)
    assert got == code and message in out["error"] and "\n" not in out["error"], out
    assert _put(url, {"prompts": ["4"], "tokens_to_generate": 1})[0] == 200  # still up


def test_busy_path_method_and_length(server):
    _, url, service = server
    assert service.slots.acquire(blocking=False)  # the one request slot is taken
    try:
        code, out = _put(url, {"prompts": ["4"], "tokens_to_generate": 1})
        assert code == 503 and "busy: 1 requests in progress" in out["error"]
    finally:
        service.slots.release()
    assert _put(url, {"prompts": ["4"], "tokens_to_generate": 1})[0] == 200
    assert _put(url.replace("/api", "/generate"), {"prompts": ["4"]})[0] == 404
    code, out = _put(url, {"prompts": ["4"]}, method="POST")
    assert code == 405 and "use PUT /api" in out["error"]
    host, port = url.split("/")[2].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("PUT", "/api")  # no Content-Length
    conn.endheaders()
    reply = conn.getresponse()
    assert reply.status == 411 and "Content-Length" in json.loads(reply.read())["error"]
    conn.close()
