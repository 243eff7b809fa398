"""Serve text generation from a megalite checkpoint over HTTP (Megatron's PUT /api).

    python tools/run_text_generation_server.py --load runs/pretrain_tiny_cpu/checkpoints --port 5000
    torchrun --nproc-per-node 2 tools/run_text_generation_server.py \
        --load runs/pretrain_tiny_cpu/checkpoints --port 5000 --tensor-model-parallel-size 2
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["And God said"], "tokens_to_generate": 30, "temperature": 0.8}'

Fields (Megatron-LM's): prompts, tokens_to_generate (0: score the prompts), temperature
(0 = greedy), top_k, top_p, random_seed, logprobs, top_n_logprobs, add_BOS, stop_token,
stop_on_eol, stop_on_double_eol, prevent_newline_after_colon, no_log (beam_width /
length_penalty: 400, no beam search); answers text, segments, tokens and, when asked,
logprobs and top_n_logprobs in Megatron's shapes. The prompts of a request are decoded
together in one batch; rank 0 prints one line per request (unless no_log). The checkpoint
(any saved layout) is loaded at the layout the flags give: one process, or under
``torchrun --nproc-per-node T*P`` tensor (``--tensor-model-parallel-size T``) and/or
pipeline (``--pipeline-model-parallel-size P``) parallel, where rank 0 serves HTTP and
sends each accepted request to the other ranks, which generate with it; SIGINT or
SIGTERM to rank 0 (Ctrl-C) stops them all. Limits: ``--max-request-bytes``
(413 beyond), ``--max-prompts`` per request, ``--max-tokens-to-generate`` (and prompt +
tokens_to_generate within the model's sequence length; 400 beyond),
``--max-concurrent-requests`` (one more gets 503). On SIGTERM / SIGINT the requests in
progress finish and every new one is answered 503 until the server stops.

The server listens on 127.0.0.1 unless ``--host`` says otherwise; on any other address it
warns unless ``--auth-token-file FILE`` is given, whose stripped content is then the token
every request must carry (``Authorization: Bearer <token>``; 401 otherwise). A port already
in use is one line (exit code 2), before the checkpoint is loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from megalite.config import ConfigError  # noqa: E402
from megalite.errors import report_tool_error  # noqa: E402

PROG = "run_text_generation_server"


# the other ranks wait in one collective for the next request: an idle server must not
# time them out
_IDLE_TIMEOUT_MINUTES = 60 * 24 * 30


def main(argv=None) -> int:
    from tools.generate import add_load_args

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000, help="0: one the OS picks")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20)
    p.add_argument("--max-prompts", type=int, default=32, help="per request")
    p.add_argument("--max-tokens-to-generate", type=int, default=None,
                   help="default: the model's sequence length")
    p.add_argument("--max-concurrent-requests", type=int, default=4)
    p.add_argument("--auth-token-file", metavar="FILE", default=None,
                   help="a file whose content (stripped) is the token every request must "
                        "send as 'Authorization: Bearer <token>' (401 otherwise)")
    args = p.parse_args(argv)
    try:
        from megalite.inference.generation import max_sequence_length
        from megalite.inference.loading import checkpoint_tokenizer, load_model, state_for_args
        from megalite.inference.server import (
            GenerationService,
            ServerLimits,
            build_server,
            check_address,
            follow,
            is_loopback,
        )

        limits = ServerLimits(args.max_request_bytes, args.max_prompts,
                              args.max_tokens_to_generate, args.max_concurrent_requests).check()
        token = read_token(args.auth_token_file)
        if os.environ.get("RANK", "0") == "0":   # the rank that will listen
            if token is None and not is_loopback(args.host):
                print(f"{PROG}: warning: --host {args.host} serves every machine that can "
                      f"reach it, with no authentication; give --auth-token-file FILE, or "
                      f"--host 127.0.0.1", file=sys.stderr, flush=True)
            check_address(args.host, args.port)
        from megalite.progress import Progress

        start = Progress(4, "server start", "step",
                         disable=os.environ.get("RANK", "0") != "0")
        start.set_postfix_str("starting the ranks")
        ps = state_for_args(args, timeout_minutes=_IDLE_TIMEOUT_MINUTES)
        start.update(1)
        start.set_postfix_str("loading the checkpoint")
        cfg, model = load_model(args.load, args.ckpt_step, ps)
        start.update(1)
        start.set_postfix_str("loading the tokenizer")
        tokenizer = checkpoint_tokenizer(cfg, args.load, args)
        start.update(1)
        if ps.rank != 0:
            return _follow(follow, model)
        service = GenerationService(model, tokenizer, max_sequence_length(cfg.model), limits,
                                    ranks=ps.world_size)
        try:
            server = build_server(service, args.host, args.port, token)
        except (OSError, ConfigError):
            start.close()
            service.stop()  # the other ranks return too
            raise
        start.update(1)
        start.close()
    except Exception as exc:
        code = report_tool_error(PROG, exc)
        if code is None:
            raise
        return code
    return _serve(server, service)


def read_token(path: str | None) -> str | None:
    """The token of ``--auth-token-file`` (its stripped content); None without the flag."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--auth-token-file {path}: cannot read it "
                          f"({getattr(exc, 'strerror', None) or exc})") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"--auth-token-file {path}: the token must be one word (the file "
                          f"holds {'nothing' if not token else 'whitespace inside it'})")
    return token


def _follow(follow, model) -> int:
    """Ranks other than 0: Ctrl-C reaches every process of the terminal's group; rank 0
    takes it and broadcasts the end, so the others ignore it and return with it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        follow(model)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def _serve(server, service) -> int:
    """Rank 0: serve (in a thread) until SIGINT / SIGTERM (or Ctrl-C); then drain -- the
    requests in progress finish, new ones are answered 503 -- and stop the other ranks."""
    from megalite.inference.server import drain

    host, port = server.server_address[:2]
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"serving PUT http://{host}:{port}/api", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        drain(server, service)
        thread.join()
    try:
        service.stop()
    except Exception as exc:  # the other ranks are gone already (torchrun stopped them)
        print(f"{PROG}: could not stop the other ranks: {str(exc).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
