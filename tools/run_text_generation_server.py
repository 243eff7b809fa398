"""Serve text generation from a megalite checkpoint over HTTP (Megatron's PUT /api).

    python tools/run_text_generation_server.py --load runs/pretrain_tiny_cpu/checkpoints --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \
        -d '{"prompts": ["And God said"], "tokens_to_generate": 30, "temperature": 0.8}'

Fields: prompts, tokens_to_generate, temperature (0 = greedy), top_k, top_p,
random_seed; the prompts of a request are decoded together in one batch. One process;
the checkpoint (any saved layout) is loaded whole. Limits: ``--max-request-bytes``
(413 beyond), ``--max-prompts`` per request, ``--max-tokens-to-generate`` (and prompt +
tokens_to_generate within the model's sequence length; 400 beyond),
``--max-concurrent-requests`` (one more gets 503).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.errors import report_tool_error  # noqa: E402

PROG = "run_text_generation_server"


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
    args = p.parse_args(argv)
    try:
        from megalite.config import ConfigError
        from megalite.inference.generation import max_sequence_length
        from megalite.inference.loading import check_inference_layout, load_for_inference
        from megalite.inference.server import GenerationService, ServerLimits, build_server

        check_inference_layout(args)
        if args.tensor_model_parallel_size != 1:
            raise ConfigError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}"
                              f": the server runs in one process; use tools/generate.py "
                              f"for tensor-parallel generation")
        limits = ServerLimits(args.max_request_bytes, args.max_prompts,
                              args.max_tokens_to_generate, args.max_concurrent_requests).check()
        cfg, model, tokenizer = load_for_inference(args.load, args.ckpt_step, args)
        service = GenerationService(model, tokenizer, max_sequence_length(cfg.model), limits)
        server = build_server(service, args.host, args.port)
    except Exception as exc:
        code = report_tool_error(PROG, exc)
        if code is None:
            raise
        return code
    host, port = server.server_address[:2]
    print(f"serving PUT http://{host}:{port}/api", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
