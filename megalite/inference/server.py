"""A text-generation HTTP server (Megatron's ``/api`` PUT interface): one process, or
world rank 0 of a model split over several (:class:`GenerationService` ``ranks``; the
others run :func:`follow`).

``PUT /api`` with a JSON body::

    {"prompts": ["text", ...], "tokens_to_generate": 64, "temperature": 1.0,
     "top_k": 0, "top_p": 0.0, "random_seed": 1234, "logprobs": true, ...}

(the fields: :mod:`megalite.inference.api_request`; ``random_seed``'s default is
``--seed``'s) answers ``{"text": [...], "segments": [...], "tokens": [...]}`` and, when
asked, ``"logprobs"`` and ``"top_n_logprobs"`` in Megatron-LM's shapes
(:mod:`megalite.inference.serving`); the prompts of one request are decoded together in
one batch. Each request to ``/api`` is one line of :attr:`GenerationService.log` (stdout
by default: time, method, status, client, prompts and tokens generated or the error,
seconds), unless the request says ``no_log``.

Bad requests answer a 4xx with ``{"error": "<one line>"}`` and the server keeps serving:
400 for malformed JSON, wrong types, unknown fields, out-of-range values and prompts
that do not fit the model (prompt tokens + ``tokens_to_generate`` beyond its sequence
length), 411 without a ``Content-Length``, 413 for a body over
``ServerLimits.max_request_bytes``, 404 for another path, 405 for another method. At
most ``max_concurrent_requests`` requests are in the server at once (the model serves
one at a time, the others wait their turn); one more gets 503 at once, and so does every
request while the server shuts down (:func:`drain`). Connections are queued up to
:data:`LISTEN_BACKLOG` deep, so that a burst is answered rather than reset. With an
``auth_token`` every request must carry ``Authorization: Bearer <token>``, else 401.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megalite.config import ConfigError
from megalite.inference.api_request import (  # noqa: F401 (re-exported)
    FIELDS,
    RequestError,
    ServerLimits,
    parse_request,
)
from megalite.inference.generation import check_prompt
from megalite.inference.serving import GenerationJob, answer, bos_id, make_rules, run_job
from megalite.parallel.collectives import broadcast_object_list

_DRAIN_LIMIT = 64 << 20  # an oversized body is read and dropped up to this many bytes
LISTEN_BACKLOG = 1024    # connections the kernel queues before the server accepts them


@dataclass
class Served:
    """What the log line of one answered request says."""

    prompts: int
    generated: int     # new tokens over all prompts
    no_log: bool = False


def log_line(method: str, path: str, client: str, status: int, seconds: float,
             served: Served | None = None, error: str | None = None) -> str:
    """One request's log line: time, method, path, client, status, then the prompts and
    tokens generated (or the error) and the seconds it took."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    what = (f"{served.prompts} prompts, {served.generated} tokens generated"
            if served is not None else f"error: {error}")
    return f"[{stamp}] {method} {path} {status} from {client}: {what}, {seconds:.3f} s"


class GenerationService:
    """The model and tokenizer behind the server; :meth:`handle` serves one request.
    ``slots`` bounds the requests in the server; ``lock`` lets one at a time use the
    model.

    ``ranks`` > 1: the model is split over that many processes (the whole world; tensor
    and/or pipeline parallel), this one world rank 0. Each accepted request -- checked
    here first, so a bad one never leaves rank 0 -- is broadcast over the world
    (``broadcast_object_list``) to the other ranks as a
    :class:`~megalite.inference.serving.GenerationJob` (token ids, sampling, stop rules,
    what to score), and they wait in :func:`follow` and generate with rank 0;
    :meth:`stop` broadcasts the end. ``log``: called with each request's log line
    (default: printed to stdout)."""

    def __init__(self, model, tokenizer, max_tokens: int, limits: ServerLimits | None = None,
                 ranks: int = 1, log=None):
        self.model, self.tokenizer, self.max_tokens = model, tokenizer, max_tokens
        self.limits = (limits or ServerLimits()).check()
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        self.ranks = ranks
        self.log = log or (lambda line: print(line, file=sys.stdout, flush=True))
        self.stopped = False
        self.draining = False    # shutting down: every new request is answered 503
        self._busy = threading.Condition()
        self._connections = 0    # connections a handler is answering

    def handle(self, body) -> dict:
        """The JSON answer of a request body (:mod:`megalite.inference.serving`)."""
        return self.serve(body)[0]

    def serve(self, body) -> tuple[dict, Served]:
        """(JSON answer, what the log line says) of a request body; raises
        :class:`RequestError` (or another ConfigError: a 400) for a bad one."""
        request = parse_request(body, self.max_tokens, self.limits)
        request.params.check()
        job = self._job(request)
        with self.lock:
            if self.stopped:
                raise RequestError("the server is shutting down", 503)
            if self.ranks > 1:
                broadcast_object_list([job], src=0)
            result = run_job(self.model, job)
        served = Served(len(job.prompts), sum(len(o) for o in result.new), request.no_log)
        return answer(self.tokenizer, request, job, result), served

    def _job(self, request) -> GenerationJob:
        """The request in token ids, checked against the model (400s naming the prompt)."""
        tok, new = self.tokenizer, request.tokens_to_generate
        ids = [tok.tokenize(p) for p in request.prompts]
        if request.add_BOS:
            bos = bos_id(tok)
            ids = [p if p[:1] == [bos] else [bos, *p] for p in ids]
        for i, prompt in enumerate(ids):
            if not prompt:
                raise RequestError(f"prompts[{i}] has no tokens; an empty prompt needs "
                                   f"add_BOS true")
            if len(prompt) + new > self.max_tokens:
                raise RequestError(
                    f"prompts[{i}] has {len(prompt)} tokens; with tokens_to_generate {new} "
                    f"that is beyond the model's sequence length of {self.max_tokens}")
            if new:
                check_prompt(prompt, self.model.config)
        return GenerationJob(ids, new, request.params, request.seed, tok.eod,
                             make_rules(tok, request), request.logprobs,
                             request.top_n_logprobs)

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


def follow(model) -> int:
    """A server rank other than 0: run each job rank 0 broadcasts over the world, until it
    broadcasts the end (None). Returns the requests served."""
    served = 0
    while True:
        job = broadcast_object_list([None], src=0)[0]
        if job is None:
            return served
        run_job(model, job)
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
            start = time.monotonic()
            try:   # the slot is free again before the client reads its answer
                status, answer, served = self._answer(length)
            finally:
                service.slots.release()
            if served is None or not served.no_log:
                service.log(log_line(self.command, self.path, self.client_address[0], status,
                                     time.monotonic() - start, served, answer.get("error")))
            return self._reply(status, answer)

        def _answer(self, length: int) -> tuple[int, dict, Served | None]:
            """(HTTP status, JSON answer, what the log says of an answered one) for a
            request body of ``length`` bytes."""
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return 400, {"error": "the body is not valid JSON"}, None
            except RecursionError:
                return 400, {"error": "the JSON body is nested too deeply"}, None
            try:
                return 200, *service.serve(body)
            except RequestError as exc:
                return exc.status, {"error": str(exc).splitlines()[0]}, None
            except (ConfigError, ValueError) as exc:  # bad requests; the server lives on
                return 400, {"error": str(exc).splitlines()[0]}, None

        def _not_allowed(self):
            if self._refused():
                return
            self._drain_length()
            self._reply(405, {"error": f"{self.command} is not served; use PUT /api"})

        do_GET = do_POST = do_DELETE = do_PATCH = _not_allowed  # noqa: N815

        def log_message(self, fmt, *args):  # http.server's own lines: service.log's instead
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
