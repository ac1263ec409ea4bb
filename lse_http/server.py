"""`lse-server`: the options, and uvicorn serving the app.

The server binds first and opens the engine in a background thread, so /health answers 503 while
the model loads. A startup failure (a bad --pool, a missing model...) prints the one-line reason on
stderr, stops uvicorn and exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from lse_core.cli import add_engine_options, config_from_args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lse-server", description="Serve a language model over an OpenAI-compatible "
                                "HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /metrics...).")
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="operator cap on reply tokens; a request asking for more gets 400 (default: 0, no cap)")
    p.add_argument("--temperature", type=float,
                   help="the server's default temperature, for requests that send none (reported as server_option)")
    p.add_argument("--parallel", type=int, default=4, help="sequences decoded together in one batch (default: 4)")
    p.add_argument("--api-key", help="require Authorization: Bearer <key> on every endpoint but /health and "
                   "the chat page at /")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    problem = _check_options(args)
    if problem:
        print(f"lse-server: {problem}", file=sys.stderr)
        return 1
    config = config_from_args(args, max_tokens=args.max_tokens, temperature=args.temperature,
                              parallel=args.parallel)

    from lse_core.api import lse_open_or_raise
    from lse_http.app import create_app

    failures: list[str] = []

    def startup_failed(reason: str) -> None:   # called from the loading thread
        print(f"lse-server: {reason}", file=sys.stderr, flush=True)
        failures.append(reason)
        server.should_exit = True

    app = create_app(lambda: lse_open_or_raise(config), api_key=args.api_key, on_load_failure=startup_failed)
    # a stream still open at shutdown is cut after 5 s, so Ctrl-C never waits on a long reply
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    server.run()
    return 1 if failures or not server.started else 0


def _check_options(args: argparse.Namespace) -> str | None:
    if args.parallel < 1:
        return f"--parallel must be at least 1, got {args.parallel}"
    if args.max_tokens < 0:
        return f"--max-tokens must be 0 (no cap) or more, got {args.max_tokens}"
    if args.kv_len < 0:
        return f"--kv-len must be 0 (the model's context) or more, got {args.kv_len}"
    if not 0 <= args.port <= 65535:
        return f"--port must be from 0 to 65535, got {args.port}"
    return None


if __name__ == "__main__":
    sys.exit(main())
