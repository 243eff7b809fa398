"""The generation server answers Megatron-style PUT /api requests (a request's prompts in
one batch) and refuses bad ones with a 4xx and one line, staying up; its limits (body
size, prompts, tokens, concurrent requests) hold. A real HTTP client against a server on
a port the OS chose."""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from megalite.config import ConfigError
from megalite.data.tokenizers import NullTokenizer
from megalite.inference.generation import generate
from megalite.inference.server import (
    GenerationService,
    ServerLimits,
    build_server,
    drain,
    is_loopback,
)
from megalite.models.gpt import GPTModel
from tests.inference.common import put_json
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
    return put_json(url, body, method, timeout=30)


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
    ({"prompts": [" ".join(["1"] * 17)], "tokens_to_generate": 0}, 400,
     "prompts[0] has 17 tokens; with tokens_to_generate 0 that is beyond the model's "
     "sequence length of 16"),
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


def _service(max_concurrent_requests=1):
    cfg = FAMILIES["llama"](vocab_size=51)
    model = GPTModel(cfg, single_process_state(), seed=3).eval()
    return GenerationService(model, NullTokenizer(50), 16,
                             ServerLimits(max_concurrent_requests=max_concurrent_requests))


def _serving(srv):
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return thread


REQUEST = json.dumps({"prompts": ["4"], "tokens_to_generate": 1}).encode()


def _raw_request(port: int, headers: str = "") -> socket.socket:
    """A connected socket that has sent PUT /api (the reply is read later)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    sock.sendall(f"PUT /api HTTP/1.0\r\nContent-Length: {len(REQUEST)}\r\n{headers}\r\n"
                 .encode() + REQUEST)
    return sock


def _status(sock: socket.socket) -> tuple[int, dict]:
    """(HTTP status, JSON body) of the reply on ``sock``; a reset raises."""
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_burst_of_connections_is_answered_not_reset():
    """50 connections made before the server accepts any (each has sent its request):
    the listen queue holds them all, and each gets an answer (503: the one slot is
    taken), where a queue of 5 dropped the rest."""
    service = _service()
    srv = build_server(service, "127.0.0.1", 0)
    port, serving = srv.server_address[1], None
    try:
        socks = [_raw_request(port) for _ in range(50)]
        assert service.slots.acquire(blocking=False)
        serving = _serving(srv)
        answers = [_status(s) for s in socks]
        service.slots.release()
        assert [code for code, _ in answers] == [503] * 50
        assert "busy: 1 requests in progress" in answers[0][1]["error"]
        assert _status(_raw_request(port))[0] == 200
    finally:
        if serving:
            srv.shutdown()
        srv.server_close()


def test_requests_during_the_drain_get_503_and_the_one_in_progress_finishes():
    service = _service(max_concurrent_requests=2)
    srv = build_server(service, "127.0.0.1", 0)
    port = srv.server_address[1]
    _serving(srv)
    service.lock.acquire()              # the model is busy: a request waits inside
    in_progress = _raw_request(port)
    for _ in range(100):                # until it holds its slot
        if service.slots._value == 1:
            break
        time.sleep(0.05)
    drainer = threading.Thread(target=drain, args=(srv, service))
    drainer.start()
    for _ in range(100):
        if service.draining:
            break
        time.sleep(0.01)
    late = _status(_raw_request(port))
    assert late == (503, {"error": "the server is shutting down; retry on another server"})
    service.lock.release()
    assert _status(in_progress)[0] == 200
    drainer.join(timeout=30)
    assert not drainer.is_alive()
    with pytest.raises(OSError):        # closed after the drain
        socket.create_connection(("127.0.0.1", port), timeout=3).close()


@pytest.fixture(scope="module")
def auth_url():
    srv = build_server(_service(), "127.0.0.1", 0, auth_token="s3cret")
    _serving(srv)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("headers, path, code", [
    ({}, "/api", 401), ({"Authorization": "Bearer wrong"}, "/api", 401),
    ({"Authorization": "s3cret"}, "/api", 401), ({}, "/other", 401),
    ({"Authorization": "Bearer s3cret"}, "/api", 200),
    ({"Authorization": "Bearer s3cret"}, "/other", 404),
])
def test_auth_token_is_checked_on_every_request(auth_url, headers, path, code):
    req = urllib.request.Request(auth_url + path, data=REQUEST, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            got, body = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        got, body = e.code, json.loads(e.read())
        if code == 401:
            assert e.headers["WWW-Authenticate"] == "Bearer"
    assert got == code
    if code == 401:
        assert body == {"error": "missing or wrong Authorization header; send 'Authorization: "
                                 "Bearer <token>' with the token of --auth-token-file"}


def _tool(argv, capsys):
    from tests.tools import load_tool

    code = load_tool("run_text_generation_server").main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_port_in_use_is_one_line_before_loading(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = _tool(["--load", str(tmp_path / "no-checkpoint"), "--port", str(port)],
                            capsys)
        assert code == 2 and lines == [
            f"run_text_generation_server: error: port {port} on 127.0.0.1 is already in use "
            f"(another server?); stop it or choose another --port (0: one the OS picks)"]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            build_server(_service(), "127.0.0.1", port)


def test_an_open_host_warns_once_without_a_token(tmp_path, capsys):
    argv = ["--load", str(tmp_path / "no-checkpoint"), "--host", "0.0.0.0", "--port", "0"]
    code, lines = _tool(argv, capsys)
    warning = [line for line in lines if "warning" in line]
    assert code != 0 and warning == [
        "run_text_generation_server: warning: --host 0.0.0.0 serves every machine that can "
        "reach it, with no authentication; give --auth-token-file FILE, or --host 127.0.0.1"]
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    _, lines = _tool([*argv, "--auth-token-file", str(token)], capsys)
    assert not [line for line in lines if "warning" in line]
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it (No such file or directory)"),
    ("", "the token must be one word (the file holds nothing)"),
    ("two words", "the token must be one word (the file holds whitespace inside it)"),
])
def test_bad_token_files_are_one_line(tmp_path, capsys, content, message):
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    code, lines = _tool(["--load", str(tmp_path), "--port", "0", "--auth-token-file",
                         str(token)], capsys)
    assert code == 2 and lines == [f"run_text_generation_server: error: --auth-token-file "
                                   f"{token}: {message}"]
