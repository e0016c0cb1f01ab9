"""`minecart serve`: load a model and serve the OpenAI-compatible HTTP API (engine/server.py).

Point any OpenAI client at http://HOST:PORT/v1. Without --api-key there is no authentication: keep
the default 127.0.0.1 unless the network is trusted. This module only parses flags, loads the model and starts
uvicorn; the endpoints live in engine/server.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import RequestError
from .run_cmd import add_model_args, start_runtime

# What `serve` says about a pretrained base model: the API's per-request switch
BASE_MODEL_NOTE = ('chat requests get the plain text of their messages to continue, unless they set '
                   '"chat_template_mode": "on" to use a chat template')


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Load a model and serve /v1/chat/completions, /v1/completions, /v1/models, "
                    "/health and /metrics.",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 exposes the API, which has "
                        "no authentication, to the network)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="model id reported by /v1/models (default: the GGUF file name)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="default max_tokens for requests that give none (default: the engine's, 2048 "
                        "for a chat answer and 256 for plain text)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: no key; also read "
                        "from the MINECART_API_KEY environment variable)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000) call the API from a "
                        "browser; repeatable, '*' allows any page (default: no web page may)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name clients may use besides the loopback names and --host (refused "
                        "otherwise, against DNS rebinding); repeatable, '*' allows any")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="generations served at once, their decode steps batched (default: 1, one "
                        "after another); later requests wait in a queue")
    p.add_argument("--max-queue", type=int, default=16, metavar="M",
                   help="requests allowed to wait for one of the --parallel slots; past that a request "
                        "gets HTTP 429 with Retry-After (default: 16)")
    p.add_argument("--no-access-log", action="store_true",
                   help="do not print the access log (one JSON line per request on stderr: time, "
                        "client, method, path, status, duration)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default: info)")
    p.set_defaults(func=serve_main)


def serve_main(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server import access_log, create_app

    if not 0 <= args.port <= 65535:
        raise RequestError(f"--port {args.port} is not a TCP port (0-65535)")
    if args.parallel < 1 or args.max_queue < 0:
        raise RequestError("--parallel must be at least 1 and --max-queue at least 0")
    _check_port_free(args.host, args.port)  # before minutes of loading, not after
    runtime = start_runtime(args, sample_memory_s=0.5, base_model_note=BASE_MODEL_NOTE,
                            parallel=args.parallel, max_queue=args.max_queue)
    try:
        api_key = args.api_key or os.environ.get("MINECART_API_KEY") or None
        if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            print(f"warning: listening on {args.host} without --api-key: anyone who can reach this "
                  "address can use the API", file=sys.stderr)
        app = create_app(runtime, model_name=args.model_name, default_max_tokens=args.max_tokens,
                         api_key=api_key, allowed_origins=args.allow_origin,
                         allowed_hosts=args.allow_host, listen_host=args.host)
        print(f"serving on http://{args.host}:{args.port}/v1 (Ctrl+C stops)", file=sys.stderr)
        if not args.no_access_log:  # one JSON line per request on stderr (engine/server.py)
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            access_log.addHandler(handler)
            access_log.setLevel(logging.INFO)
            access_log.propagate = False
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=3, access_log=False)
    finally:
        runtime.close()
    return 0


def _check_port_free(host: str, port: int) -> None:
    import socket

    if port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise RequestError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port "
                           "or stop the program using it") from exc
