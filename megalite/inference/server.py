"""A text-generation HTTP server (Megatron's ``/api`` PUT interface), one process.

``PUT /api`` with a JSON body::

    {"prompts": ["text", ...], "tokens_to_generate": 64, "temperature": 1.0,
     "top_k": 0, "top_p": 0.0, "random_seed": 1234}

answers ``{"text": [detokenized prompt + continuation, ...], "tokens": [[ids], ...]}``; a malformed
request (wrong types, out-of-range or oversized fields) answers 400 with
``{"error": "<one line>"}`` and the server keeps serving. Requests are served one at a
time (one lock around the model).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megalite.config import ConfigError
from megalite.inference.generation import generate
from megalite.inference.sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20
MAX_PROMPTS = 32
MAX_PROMPT_CHARS = 100_000


class RequestError(ConfigError):
    """A request the server refuses (HTTP 400)."""


def _number(body: dict, key: str, default, kind, lo, hi):
    value = body.get(key, default)
    ok = (isinstance(value, int) if kind is int else isinstance(value, (int, float)))
    if not ok or isinstance(value, bool):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, "
                           f"got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value}")
    return kind(value)


def parse_request(body, max_tokens: int) -> tuple[list[str], int, SamplingParams, int]:
    """(prompts, tokens_to_generate, sampling params, seed) of a request body (parsed
    JSON); raises :class:`RequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = set(body) - {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p",
                           "random_seed"}
    if unknown:
        raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    if any(len(p) > MAX_PROMPT_CHARS for p in prompts):
        raise RequestError(f"a prompt is longer than {MAX_PROMPT_CHARS} characters")
    new = _number(body, "tokens_to_generate", min(64, max_tokens), int, 0, max_tokens)
    params = SamplingParams(_number(body, "temperature", 1.0, float, 0.0, 100.0),
                            _number(body, "top_k", 0, int, 0, 1 << 30),
                            _number(body, "top_p", 0.0, float, 0.0, 1.0))
    seed = _number(body, "random_seed", 1234, int, 0, 2**63 - 1)
    return prompts, new, params, seed


class GenerationService:
    """The model and tokenizer behind the server; :meth:`handle` serves one request."""

    def __init__(self, model, tokenizer, max_tokens: int):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.lock = threading.Lock()

    def handle(self, body) -> dict:
        prompts, new, params, seed = parse_request(body, self.max_tokens)
        tok = self.tokenizer
        with self.lock:
            generator = torch.Generator().manual_seed(seed)
            texts, tokens = [], []
            for prompt in prompts:
                ids = tok.tokenize(prompt)
                out = generate(self.model, ids, new, params, eod=tok.eod, generator=generator)
                text_ids = out[:-1] if out and out[-1] == tok.eod else out
                texts.append(tok.detokenize(ids + text_ids))
                tokens.append(ids + out)
        return {"text": texts, "tokens": tokens}


def make_handler(service: GenerationService):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/api":
                return self._reply(404, {"error": f"no endpoint {self.path}; use PUT /api"})
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                return self._reply(400, {"error": "bad Content-Length"})
            if not 0 < length <= MAX_BODY_BYTES:
                return self._reply(400, {"error": f"the body must be 1..{MAX_BODY_BYTES} "
                                                  f"bytes, got {length}"})
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return self._reply(400, {"error": "the body is not valid JSON"})
            try:
                return self._reply(200, service.handle(body))
            except (ConfigError, ValueError) as exc:  # bad requests; the server lives on
                return self._reply(400, {"error": str(exc).splitlines()[0]})

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr
            pass

    return Handler


def build_server(service: GenerationService, host: str, port: int) -> ThreadingHTTPServer:
    return ThreadingHTTPServer((host, port), make_handler(service))
