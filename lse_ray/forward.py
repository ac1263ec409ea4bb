"""The seam between the ingress and a replica: an HTTP request as plain data, and running it through the
replica's own lse-server app (lse_http.app) in-process, its ASGI messages streamed back as they are sent.

Nothing of the request is interpreted here: the replica's app checks the key, the Host, the body and every
field, and builds every body, SSE event and error exactly as lse-server does. The caller stopping (its client
gone, Ray cancelling the call) is the app's client disconnecting: it cancels the sequence at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Scope

log = logging.getLogger("lse")


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request, as the ingress read it. ``affinity_key``: the prefix key the router follows."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    affinity_key: int | None = None

    @classmethod
    def of(cls, scope: Scope, body: bytes, affinity_key: int | None) -> ForwardedRequest:
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), list(scope["headers"]), body,
                   affinity_key)

    def scope(self) -> Scope:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": self.headers, "client": ("127.0.0.1", 0),
                "server": ("127.0.0.1", 80)}


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """The app's response to ``request``: its http.response.start message, then each body message. Closing
    this generator early (or cancelling it) tells the app its client has gone."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda t: (sent.put_nowait(None), _log_failure(t)))
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        gone.set()


def _log_failure(task: asyncio.Task[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        if task.exception() is not None:
            log.error("lse: the app failed on a forwarded request", exc_info=task.exception())
