"""A text-generation HTTP server (Megatron's ``/api`` PUT interface): one process, or
world rank 0 of a model split over several (:class:`GenerationService` ``ranks``; the
others run :func:`follow`).

``PUT /api`` with a JSON body::

    {"prompts": ["text", ...], "tokens_to_generate": 64, "temperature": 1.0,
     "top_k": 0, "top_p": 0.0, "random_seed": 1234}

(``random_seed``'s default is ``--seed``'s) answers ``{"text": [detokenized prompt +
continuation, ...], "tokens": [[ids], ...]}``; the prompts of one request are decoded
together in one batch. Bad requests answer a 4xx with ``{"error": "<one line>"}`` and
the server keeps serving: 400 for malformed JSON, wrong types, unknown fields,
out-of-range values and prompts that do not fit the model (prompt tokens +
``tokens_to_generate`` beyond its sequence length), 411 without a ``Content-Length``,
413 for a body over ``ServerLimits.max_request_bytes``, 404 for another path, 405 for
another method. At most ``max_concurrent_requests`` requests are in the server at once
(the model serves one at a time, the others wait their turn); one more gets 503 at once,
and so does every request while the server shuts down (:func:`drain`). Connections are
queued up to :data:`LISTEN_BACKLOG` deep, so that a burst is answered rather than reset.
With an ``auth_token`` every request must carry ``Authorization: Bearer <token>``, else
401.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megalite.config import ConfigError
from megalite.config.run import DEFAULT_SEED
from megalite.inference.generation import check_prompt, generate_batch
from megalite.inference.sampling import SamplingParams
from megalite.parallel.collectives import broadcast_object_list

FIELDS = ("prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed")
_DRAIN_LIMIT = 64 << 20  # an oversized body is read and dropped up to this many bytes
LISTEN_BACKLOG = 1024    # connections the kernel queues before the server accepts them


@dataclass
class ServerLimits:
    """What one request may ask for (the tool's flags of the same names)."""

    max_request_bytes: int = 4 << 20   # --max-request-bytes
    max_prompts: int = 32              # --max-prompts (per request)
    max_tokens_to_generate: int | None = None  # --max-tokens-to-generate (None: seq length)
    max_concurrent_requests: int = 4   # --max-concurrent-requests (more: 503)

    def check(self) -> ServerLimits:
        for name in ("max_request_bytes", "max_prompts", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got "
                                  f"{getattr(self, name)}")
        if self.max_tokens_to_generate is not None and self.max_tokens_to_generate < 0:
            raise ConfigError(f"--max-tokens-to-generate must be >= 0, got "
                              f"{self.max_tokens_to_generate}")
        return self


class RequestError(ConfigError):
    """A request the server refuses; ``status`` is its HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _number(body: dict, key: str, default, kind, lo, hi):
    value = body.get(key, default)
    ok = (isinstance(value, int) if kind is int else isinstance(value, (int, float)))
    if not ok or isinstance(value, bool):
        raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, "
                           f"got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise RequestError(f"{key} must be in [{lo}, {hi}], got {value}")
    return kind(value)


def parse_request(body, max_tokens: int, limits: ServerLimits | None = None
                  ) -> tuple[list[str], int, SamplingParams, int]:
    """(prompts, tokens_to_generate, sampling params, seed) of a request body (parsed
    JSON); raises :class:`RequestError` naming the bad field. ``max_tokens``: the model's
    sequence length."""
    limits = limits or ServerLimits()
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise RequestError(f"unknown fields: {', '.join(sorted(unknown))[:200]} "
                           f"(known: {', '.join(FIELDS)})")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) for p in prompts):
        raise RequestError("prompts must be a non-empty list of strings")
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"at most {limits.max_prompts} prompts per request, got "
                           f"{len(prompts)}")
    cap = max_tokens if limits.max_tokens_to_generate is None else min(
        max_tokens, limits.max_tokens_to_generate)
    new = _number(body, "tokens_to_generate", min(64, cap), int, 0, cap)
    params = SamplingParams(_number(body, "temperature", 1.0, float, 0.0, 100.0),
                            _number(body, "top_k", 0, int, 0, 1 << 30),
                            _number(body, "top_p", 0.0, float, 0.0, 1.0))
    seed = _number(body, "random_seed", DEFAULT_SEED, int, 0, 2**63 - 1)
    return prompts, new, params, seed


class GenerationService:
    """The model and tokenizer behind the server; :meth:`handle` serves one request.
    ``slots`` bounds the requests in the server; ``lock`` lets one at a time use the
    model.

    ``ranks`` > 1: the model is split over that many processes (the whole world; tensor
    and/or pipeline parallel), this one world rank 0. Each accepted request -- checked
    here first, so a bad one never leaves rank 0 -- is broadcast over the world
    (``broadcast_object_list``) to the other ranks, which wait in :func:`follow` and
    generate with rank 0; :meth:`stop` broadcasts the end."""

    def __init__(self, model, tokenizer, max_tokens: int, limits: ServerLimits | None = None,
                 ranks: int = 1):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.limits = (limits or ServerLimits()).check()
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        self.ranks = ranks
        self.stopped = False
        self.draining = False    # shutting down: every new request is answered 503
        self._busy = threading.Condition()
        self._connections = 0    # connections a handler is answering

    def handle(self, body) -> dict:
        prompts, new, params, seed = parse_request(body, self.max_tokens, self.limits)
        params.check()
        tok = self.tokenizer
        ids = [tok.tokenize(p) for p in prompts]
        for i, prompt in enumerate(ids):
            if len(prompt) + new > self.max_tokens:
                raise RequestError(
                    f"prompts[{i}] has {len(prompt)} tokens; with tokens_to_generate {new} "
                    f"that is beyond the model's sequence length of {self.max_tokens}")
            check_prompt(prompt, self.model.config)
        request = (ids, new, params, seed, tok.eod)
        with self.lock:
            if self.stopped:
                raise RequestError("the server is shutting down", 503)
            if self.ranks > 1:
                broadcast_object_list([request], src=0)
            outs = _generate(self.model, request)
        texts = [tok.detokenize(p + (o[:-1] if o[-1:] == [tok.eod] else o))
                 for p, o in zip(ids, outs)]
        return {"text": texts, "tokens": [p + o for p, o in zip(ids, outs)]}

    def _enter(self) -> None:
        with self._busy:
            self._connections += 1

    def _leave(self) -> None:
        with self._busy:
            self._connections -= 1
            self._busy.notify_all()

    def wait_quiet(self, timeout_s: float) -> bool:
        """Wait until no connection is being answered (at most ``timeout_s``)."""
        with self._busy:
            return self._busy.wait_for(lambda: self._connections == 0, timeout_s)

    def stop(self) -> None:
        """No more requests; the other ranks' :func:`follow` returns (after the request
        in progress, if any)."""
        with self.lock:
            if not self.stopped and self.ranks > 1:
                broadcast_object_list([None], src=0)
            self.stopped = True


def _generate(model, request) -> list[list[int]]:
    ids, new, params, seed, eod = request
    return generate_batch(model, ids, new, params, eod=eod,
                          generator=torch.Generator().manual_seed(seed))


def follow(model) -> int:
    """A server rank other than 0: generate each request rank 0 broadcasts over the world,
    until it broadcasts the end (None). Returns the requests served."""
    served = 0
    while True:
        request = broadcast_object_list([None], src=0)[0]
        if request is None:
            return served
        _generate(model, request)
        served += 1


def make_handler(service: GenerationService, auth_token: str | None = None):
    limit = service.limits.max_request_bytes
    expected = None if auth_token is None else f"Bearer {auth_token}".encode()

    class Handler(BaseHTTPRequestHandler):
        def handle(self):
            service._enter()
            try:
                super().handle()
            finally:
                service._leave()

        def _refused(self) -> bool:
            """Answer (and return True) a request without the token, or one that arrives
            while the server shuts down."""
            if expected is not None:
                given = (self.headers.get("Authorization") or "").strip().encode()
                if not hmac.compare_digest(given, expected):
                    self._drain_length()
                    self._reply(401, {"error": "missing or wrong Authorization header; send "
                                               "'Authorization: Bearer <token>' with the "
                                               "token of --auth-token-file"},
                                {"WWW-Authenticate": "Bearer"})
                    return True
            if service.draining:
                self._drain_length()
                self._reply(503, {"error": "the server is shutting down; retry on another "
                                           "server"})
                return True
            return False

        def _drain_length(self) -> None:
            try:
                self._drain(int(self.headers.get("Content-Length") or 0))
            except ValueError:
                pass

        def _reply(self, code: int, payload: dict, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _drain(self, length: int) -> None:
            """Read and drop an unwanted body, so the client reads the reply rather than
            a reset connection (bounded: past that the connection just closes)."""
            left = min(length, _DRAIN_LIMIT)
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)

        def do_PUT(self):  # noqa: N802 (http.server's naming)
            if self._refused():
                return None
            raw = self.headers.get("Content-Length")
            try:
                length = int(raw) if raw is not None else None
            except ValueError:
                return self._reply(400, {"error": f"bad Content-Length {raw[:40]!r}"})
            if length is None:
                return self._reply(411, {"error": "a Content-Length header is required"})
            if self.path.rstrip("/") != "/api":
                self._drain(length)
                return self._reply(404, {"error": f"no endpoint {self.path[:100]}; use "
                                                  f"PUT /api"})
            if length > limit:
                self._drain(length)
                return self._reply(413, {"error": f"the body has {length} bytes; at most "
                                                  f"{limit} (--max-request-bytes)"})
            if length <= 0:
                return self._reply(400, {"error": "the body is empty; send a JSON object"})
            if not service.slots.acquire(blocking=False):
                self._drain(length)
                busy = service.limits.max_concurrent_requests
                return self._reply(503, {"error": f"busy: {busy} requests in progress "
                                                  f"(--max-concurrent-requests); retry"})
            try:   # the slot is free again before the client reads its answer
                status, answer = self._answer(length)
            finally:
                service.slots.release()
            return self._reply(status, answer)

        def _answer(self, length: int) -> tuple[int, dict]:
            """(HTTP status, JSON answer) for a request body of ``length`` bytes."""
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return 400, {"error": "the body is not valid JSON"}
            except RecursionError:
                return 400, {"error": "the JSON body is nested too deeply"}
            try:
                return 200, service.handle(body)
            except RequestError as exc:
                return exc.status, {"error": str(exc).splitlines()[0]}
            except (ConfigError, ValueError) as exc:  # bad requests; the server lives on
                return 400, {"error": str(exc).splitlines()[0]}

        def _not_allowed(self):
            if self._refused():
                return
            self._drain_length()
            self._reply(405, {"error": f"{self.command} is not served; use PUT /api"})

        do_GET = do_POST = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a deep listen queue (its default, 5, resets a burst of
    connections before they are accepted)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


def _listen_error(exc: OSError, host: str, port: int) -> ConfigError:
    """A one-line ConfigError for a socket that cannot listen on ``host:port``."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"port {port} on {host} is already in use (another server?); stop "
                           f"it or choose another --port (0: one the OS picks)")
    if exc.errno == errno.EACCES:
        return ConfigError(f"port {port} on {host}: permission denied (ports below 1024 need "
                           f"privileges); choose another --port")
    reason = exc.strerror or str(exc)
    return ConfigError(f"cannot listen on {host}:{port} ({reason}); check --host and --port")


def check_address(host: str, port: int) -> None:
    """Raise :class:`ConfigError` (one line naming the port) if the server could not listen
    on ``host:port``; run before loading a model, so a taken port costs no load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the server
            sock.bind((host, port))
    except OSError as exc:
        raise _listen_error(exc, host, port) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (127.0.0.0/8, ::1,
    localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_server(service: GenerationService, host: str, port: int,
                 auth_token: str | None = None) -> ThreadingHTTPServer:
    """The HTTP server of ``service`` listening on ``host:port`` (not yet serving:
    ``serve_forever``); ``auth_token``: the bearer token every request must carry.
    :class:`ConfigError` when it cannot listen there (a port in use, ...)."""
    if auth_token is not None and not auth_token:
        raise ConfigError("the authentication token is empty")
    try:
        return _Server((host, port), make_handler(service, auth_token))
    except OSError as exc:
        raise _listen_error(exc, host, port) from None


def drain(server: ThreadingHTTPServer, service: GenerationService,
          grace_s: float = 10.0) -> None:
    """Shut the server down without resetting a connection: every new request is
    answered 503 while the requests in progress finish; then the serving loop (running in
    another thread) stops, the connections still queued are answered 503 here (each
    within ``grace_s``), and the listening socket closes."""
    service.draining = True
    for _ in range(service.limits.max_concurrent_requests):   # the requests in progress
        service.slots.acquire()
    server.shutdown()
    server.socket.settimeout(0)
    while True:
        try:
            request, address = server.get_request()
        except OSError:   # none left
            break
        request.settimeout(grace_s)
        try:
            server.finish_request(request, address)
        except OSError:
            pass
        finally:
            server.shutdown_request(request)
    deadline = time.monotonic() + grace_s
    service.wait_quiet(max(0.0, deadline - time.monotonic()))
    server.server_close()
    for _ in range(service.limits.max_concurrent_requests):
        service.slots.release()
