"""The ingress: one URL in front of the replicas, serving lse-server's HTTP API by forwarding each request
whole to a replica's own app (forward.py) and streaming its answer back unchanged.

It adds only what one replica cannot know: the request's prefix-affinity key (affinity.PromptKeys), the
retry of a request whose replica was lost before anything of its answer came back (a stream ends instead
with the spec's in-stream error), and /v1/lse/status's ``replicas`` list.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message

from lse_core.errors import server_error
from lse_http.app import ERROR_HANDLERS, MAX_BODY_BYTES, stream_error_bytes
from lse_ray.affinity import PromptKeys
from lse_ray.forward import ForwardedRequest
from lse_ray.router import ROUTERS

log = logging.getLogger("lse")

REPLICA_LOST = (RayActorError, ActorUnavailableError)   # the replica's process died or cannot be reached
ATTEMPTS = 3            # replicas tried for a request before it gets 503 replica_lost
METHODS = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]   # the replica's app answers each


@serve.ingress()
class LSEIngress:
    def __init__(self, replicas: DeploymentHandle, model: str | None, replica_deployment: str,
                 prefix_affinity: bool = True) -> None:
        self.replicas = replicas.options(stream=True)
        self.keys = PromptKeys(model) if prefix_affinity else None
        self.replica_deployment = replica_deployment

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [Route("/v1/lse/status", self.status, methods=["GET"]),
                  Route("/{path:path}", self.forward, methods=METHODS)]
        return Starlette(routes=routes, exception_handlers=ERROR_HANDLERS)

    async def forward(self, request: Request) -> Response:
        start, body, stream = await self._answer(request)
        if stream is None:
            return _whole(start, body)
        return ReplicaStream(start, stream, request.url.path)

    async def status(self, request: Request) -> Response:
        """A replica's lse_status, with every replica's devices, load and counters under ``replicas``."""
        start, body, _ = await self._answer(request)
        if start["status"] != 200:
            return _whole(start, body)
        status = json.loads(b"".join(body))
        router = ROUTERS.get(self.replica_deployment)
        status["replicas"] = router.replica_stats() if router is not None else []
        return Response(json.dumps(status), media_type="application/json")

    async def _answer(self, request: Request) -> tuple[Message, list[bytes], DeploymentResponseGenerator | None]:
        """A replica's answer: its response start and, for a whole response, its body (stream None); for a
        stream, the generator of its body messages. A request whose replica is lost before any of its answer
        arrives goes to another replica."""
        body = await _read_body(request)
        key = None
        if self.keys is not None and request.method == "POST":
            key = await run_in_threadpool(self.keys.key, request.url.path, body)
        forwarded = ForwardedRequest.of(request.scope, body, key)
        lost: Exception | None = None
        for _ in range(ATTEMPTS):
            answer = self.replicas.call.remote(forwarded)
            try:
                start = await answer.__anext__()
                if _is_stream(start):
                    return start, [], answer
                return start, [m.get("body", b"") async for m in answer], None
            except REPLICA_LOST as e:
                log.warning("lse: a replica was lost before answering; retrying on another: %s", e)
                lost = e
        raise server_error(f"no replica could answer: {lost}", code="replica_lost", status=503)


class ReplicaStream(StreamingResponse):
    """A replica's stream, relayed as it comes; a replica lost mid-stream ends it with the in-stream error.
    However it ends (the client gone included), the replica's call is cancelled, which cancels its sequence."""

    def __init__(self, start: Message, answer: DeploymentResponseGenerator, path: str) -> None:
        super().__init__(_relay(answer, path), status_code=start["status"])
        self.raw_headers = [(bytes(k), bytes(v)) for k, v in start["headers"]]


async def _relay(answer: DeploymentResponseGenerator, path: str) -> AsyncIterator[bytes]:
    events = 0
    try:
        async for message in answer:
            if message.get("body"):
                events += 1
                yield message["body"]
    except REPLICA_LOST as e:
        log.warning("lse: a replica was lost mid-stream: %s", e)
        error = server_error("the replica serving this stream was lost; retry the request", code="replica_lost",
                             status=503)
        yield stream_error_bytes(path, error, events)
    finally:
        answer.cancel()


def _is_stream(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])


def _whole(start: Message, body: list[bytes]) -> Response:
    response = Response(b"".join(body), status_code=start["status"])
    response.raw_headers = [(bytes(k), bytes(v)) for k, v in start["headers"]]
    return response


async def _read_body(request: Request) -> bytes:
    """The body, read up to one byte past the limit: the replica's app refuses a body that large (413)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            break
    return b"".join(chunks)
