"""`lse-server`: the options, and uvicorn serving the app.

The server binds first and opens the engine in a background thread, so /health answers 503 while
the model loads. A startup failure (a bad --pool, a missing model...) prints the one-line reason on
stderr, stops uvicorn and exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from lse_core.cli import add_engine_options, config_from_args

log = logging.getLogger("lse")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lse-server", description="Serve a language model over an OpenAI-compatible "
                                "HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /metrics...).")
    add_engine_options(p, many_models=True)
    p.add_argument("--models-dir", help="serve every .gguf file and Hugging Face directory in DIR, each by its name")
    p.add_argument("--alias", action="append", default=[], metavar="ID=PATH",
                   help="serve the model at PATH as ID (repeatable)")
    p.add_argument("--max-models", type=int, default=0,
                   help="models open at once; the least recently used idle one is unloaded to open another "
                        "(default: 0, no limit)")
    p.add_argument("--memory-budget", type=_size, default=0, metavar="SIZE",
                   help="memory the open models may take together, e.g. 8G or 512M; the least recently used idle "
                        "ones are unloaded to fit another (default: 0, no limit)")
    p.add_argument("--idle-unload", type=float, default=0.0, metavar="SECONDS",
                   help="unload a model after this many seconds without a request (default: 0, never)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="operator cap on reply tokens; a request asking for more gets 400 (default: 0, no cap)")
    p.add_argument("--temperature", type=float,
                   help="the server's default temperature, for requests that send none (reported as server_option)")
    p.add_argument("--parallel", type=int, default=4, help="sequences decoded together in one batch (default: 4)")
    p.add_argument("--api-key", help="require Authorization: Bearer <key> on every endpoint but /health and "
                   "the chat page at /")
    p.add_argument("--cors-origins", type=_names, default=[],
                   help="comma-separated origins whose web pages may call the API (e.g. http://localhost:3000, or "
                        "* for any); default: none, so browsers refuse other sites' pages")
    p.add_argument("--allowed-hosts", type=_names, default=[],
                   help="comma-separated Host names to answer besides localhost, 127.0.0.1 and ::1 when bound to "
                        "loopback (against DNS rebinding), or * for any; bound elsewhere, the only names answered "
                        "when given (default: none)")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a stream may wait on a client that reads nothing (its sequence paused, holding "
                        "its KV slot) before the request is ended (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running replies may take to finish after SIGTERM/SIGINT; then each is ended "
                        "with an error event (default: %(default)s)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection stays open after an answer, for the client's next request "
                        "(default: %(default)s)")
    p.add_argument("--header-timeout", type=float, default=20.0,
                   help="seconds a connection may take to send a whole request's headers, counted from when it "
                        "opens or from its last answer; then it is closed, so connections that send nothing, or "
                        "a byte at a time, hold no socket (default: %(default)s)")
    p.add_argument("--websocket-idle-timeout", type=float, default=300.0,
                   help="seconds a Responses WebSocket may wait to send its next message, counted from when it "
                        "opens or from its last response's end; then it is closed (default: %(default)s)")
    ray = p.add_argument_group("scale-out (Ray Serve; pip install 'lse[ray]'; see docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, default=0,
                     help="serve through N engine replicas on Ray Serve behind this address (default: 0, one "
                          "engine in this process)")
    ray.add_argument("--ray-address", help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of "
                     "starting a local Ray instance")
    ray.add_argument("--ray-actor-options", type=json.loads, default=None,
                     help='each replica\'s Ray resources as JSON, e.g. \'{"num_gpus": 1}\' (default: one CPU)')
    ray.add_argument("--autoscaling-config", type=json.loads, default=None,
                     help="Ray Serve's autoscaling config for the replicas as JSON, e.g. "
                          "'{\"min_replicas\": 1, \"max_replicas\": 4, \"target_ongoing_requests\": 4}'")
    ray.add_argument("--no-prefix-affinity", action="store_true",
                     help="send every request to the least-loaded replica, ignoring its prompt's prefix")
    return p.parse_args(argv)


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(value: str) -> int:
    """Bytes of ``8G``, ``512M``, ``1.5GiB``, ``4096``..., in powers of 1024."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in SIZE_UNITS else ""
    try:
        size = float(text[: len(text) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size such as 8G, 512M or 4096") from None
    if not 0 <= size < 1 << 60:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size such as 8G, 512M or 4096")
    return int(size * SIZE_UNITS[unit])


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    problem = _check_options(args)
    if problem:
        print(f"lse-server: {problem}", file=sys.stderr)
        return 1
    config = config_from_args(args, max_tokens=args.max_tokens, temperature=args.temperature,
                              parallel=args.parallel)

    from lse_core.errors import StartupError
    from lse_core.model.catalog import model_specs
    from lse_core.model_set import ModelSet, Policy
    from lse_http.app import create_app
    from lse_http.browser import allowed_hosts

    try:
        specs = model_specs(args.models, args.models_dir, args.alias)
    except StartupError as e:
        print(f"lse-server: {e}", file=sys.stderr)
        return 1
    policy = Policy(max_models=args.max_models, memory_budget=args.memory_budget, idle_unload=args.idle_unload,
                    max_waiting=config.max_queue)

    failures: list[str] = []

    def startup_failed(reason: str) -> None:   # called from the loading thread
        print(f"lse-server: {reason}", file=sys.stderr, flush=True)
        failures.append(reason)
        server.should_exit = True

    hosts = None if "*" in args.allowed_hosts else allowed_hosts(args.host, args.allowed_hosts)
    if args.replicas or args.ray_address or args.autoscaling_config:
        from lse_ray.cluster import serve_replicas

        if len(specs) > 1:
            print("lse-server: --replicas serves one model; give one -m (or run a Ray Serve application per model)",
                  file=sys.stderr)
            return 1
        config = dataclasses.replace(config, model=specs[0].path, model_id=specs[0].id)
        return serve_replicas(args, config, {"api_key": args.api_key, "allowed_hosts": hosts,
                                             "cors_origins": args.cors_origins, "stall_timeout": args.stall_timeout})
    app = create_app(ModelSet(specs, config, policy), api_key=args.api_key, on_load_failure=startup_failed,
                     allowed_hosts=hosts, cors_origins=args.cors_origins, stall_timeout=args.stall_timeout,
                     websocket_idle_timeout=args.websocket_idle_timeout)
    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout=args.header_timeout)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           http=protocol, timeout_keep_alive=args.timeout_keep_alive,
                                           timeout_graceful_shutdown=args.shutdown_timeout + DRAIN_GRACE_S),
                            drain=app.state.running.abort_all, drain_after=args.shutdown_timeout)
    server.run()
    return 1 if failures or not server.started else 0


DRAIN_GRACE_S = 5.0   # after the drain time, for the ended streams to send their error event and close
# Each connection's kernel send buffer, fixed: the kernel would grow it to 4 MiB for a client that reads
# nothing, and a stream paused by backpressure (lse_http.app.StreamEvents) should stop within ~2k tokens of
# the client's last read, not 25k. 256 KiB (the kernel doubles the value) still fills a 100 ms link at 2.5 MB/s.
SEND_BUFFER_BYTES = 128 << 10


class HeaderTimeoutProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, closing a connection that has not sent a whole request's headers
    ``header_timeout`` seconds after it opened or after its last answer. uvicorn's own keep-alive timer starts
    only after an answer and stops at the next byte, so a connection that sends nothing, or a byte now and
    then (slowloris), would hold its socket for good. A connection upgraded to a WebSocket is the WebSocket's
    from then on: the timer stops, and the app closes an idle one (--websocket-idle-timeout)."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, *args: Any) -> None:
        # the transport passes to the WebSocket's protocol: this one hears of no answer, nor of the connection's end
        self._stop_waiting()
        super().handle_websocket_upgrade(*args)

    def _stop_waiting(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()

    def _wait_for_headers(self) -> None:
        self._stop_waiting()
        if not self.transport.is_closing():
            self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        # a request whose headers came is being answered (a pipelined one too): its answer re-arms the timer
        answering = self.cycle is not None and not self.cycle.response_complete
        if not answering and not self.transport.is_closing():
            log.info("lse: closing a connection that sent no request's headers in %g s", self.header_timeout)
            self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn, stopping as a server behind a load balancer should: on SIGTERM/SIGINT it stops accepting,
    lets running replies finish for ``drain_after`` seconds, then calls ``drain`` (which ends each remaining
    one with an error event, so no stream is cut mid-way), and exits 0: the signal asked for this exit."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None], drain_after: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_after = drain_after

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for server in getattr(self, "servers", []):   # accepted connections inherit the listener's buffer size
            for listener in server.sockets:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_after, self.drain)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()   # uvicorn would re-raise the signal and die by it


def _check_options(args: argparse.Namespace) -> str | None:
    if args.stall_timeout <= 0:
        return f"--stall-timeout must be more than 0 seconds, got {args.stall_timeout}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}"
    if args.timeout_keep_alive <= 0:
        return f"--timeout-keep-alive must be more than 0 seconds, got {args.timeout_keep_alive}"
    if args.header_timeout <= 0:
        return f"--header-timeout must be more than 0 seconds, got {args.header_timeout}"
    if args.websocket_idle_timeout <= 0:
        return f"--websocket-idle-timeout must be more than 0 seconds, got {args.websocket_idle_timeout}"
    if args.replicas < 0:
        return f"--replicas must be 0 (no Ray) or more, got {args.replicas}"
    if args.parallel < 1:
        return f"--parallel must be at least 1, got {args.parallel}"
    if args.max_models < 0:
        return f"--max-models must be 0 (no limit) or more, got {args.max_models}"
    if args.idle_unload < 0:
        return f"--idle-unload must be 0 (never) or more seconds, got {args.idle_unload}"
    if args.max_tokens < 0:
        return f"--max-tokens must be 0 (no cap) or more, got {args.max_tokens}"
    if args.kv_len < 0:
        return f"--kv-len must be 0 (the model's context) or more, got {args.kv_len}"
    if not 0 <= args.port <= 65535:
        return f"--port must be from 0 to 65535, got {args.port}"
    return None


if __name__ == "__main__":
    sys.exit(main())
