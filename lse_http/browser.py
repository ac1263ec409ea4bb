"""What keeps a web page on another site from using the server through the visitor's browser.

A page can make the browser send requests to http://127.0.0.1:8080 without asking anyone. Three things stop
it from getting answers or doing work:
- JSON endpoints take only ``Content-Type: application/json`` (lse_http.app); the other types (text/plain,
  forms, none) are the ones a page may send without a CORS preflight.
- CORS is off unless ``--cors-origins`` names the origins whose pages may call the API (starlette's
  CORSMiddleware), so the browser refuses the preflight of any other page.
- When bound to loopback, the Host header must name a loopback host (or one of ``--allowed-hosts``): a DNS
  rebinding page reaches 127.0.0.1 under its own host name, which this refuses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from lse_core.errors import LSEError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether a --host value listens on loopback only."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, extra: list[str]) -> list[str] | None:
    """The Host names the server answers: loopback names when bound to loopback, plus ``extra``; None (any
    host) when bound elsewhere and no ``extra`` is given, as a server behind a proxy or on a LAN expects."""
    if is_loopback(bind):
        return [*LOOPBACK_NAMES, bind.strip("[]"), *extra]
    return list(extra) or None


def host_name(header: str) -> str:
    """The host of a Host header, without its port: "[::1]:8080" -> "::1", "Localhost:80" -> "localhost"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostCheckMiddleware:
    """403 ``host_not_allowed`` for a request whose Host header is not one of ``hosts``."""

    def __init__(self, app: ASGIApp, hosts: list[str],
                 render_error: Callable[[str, LSEError], Response]) -> None:
        self.app = app
        self.hosts = {h.lower() for h in hosts}
        self.render_error = render_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):   # a refused WebSocket handshake gets the 403
            host = host_name(Headers(scope=scope).get("host", ""))
            if host not in self.hosts:
                error = LSEError(f"the Host header names {host or 'no host'!r}, which this server does not answer "
                                 f"to (it answers {', '.join(sorted(self.hosts))}); start lse-server with "
                                 "--allowed-hosts to add a name", status=403, type="permission_error",
                                 code="host_not_allowed")
                await self.render_error(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
