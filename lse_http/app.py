"""The OpenAI-compatible starlette app: a thin transport over lse_core.api.

Every JSON body a client receives is made by lse_core (protocol shapes, api results, LSEError
bodies); this module moves bytes. It reads and bounds request bodies, bridges engine events (which
arrive on the engine's thread) into asyncio, writes JSON or server-sent events, and cancels a
request whose client has gone, so its sequence ends at the next engine step and frees its KV slot.

Every route that names a model leases it from the server's ModelSet (lse_core.model_set), which opens it
on demand and keeps it open while the request runs. A server of one model opens it in the background at
startup: it binds at once and /health answers 503 {"status": "loading"} until the model is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from lse_core import api
from lse_core.adapters import responses as responses_api
from lse_core.errors import LSEError, invalid_request, server_error
from lse_core.model_set import Lease, ModelSet, requested_model
from lse_core.protocol import detokenized, health_body, parse_detokenize
from lse_http.browser import HostCheckMiddleware
from lse_http.metrics import prometheus_text
from lse_http.openapi import OPENAPI, served_document

log = logging.getLogger("lse")

MAX_BODY_BYTES = 8 << 20          # request bodies above this get 413 before they are read whole
PAGE_DIR = Path(__file__).parent / "page"   # the chat page: index.html and the files it loads from /page/
# answered without the API key: /health so load balancers can probe, the page so it can ask for the key
OPEN_PATHS = ("/health", "/")
OPEN_PREFIXES = ("/page/",)
# the page runs only its own files: model text that slipped into the DOM as markup could run nothing
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SSE_DONE = b"data: [DONE]\n\n"
STALL_TIMEOUT_S = 30.0    # a stream whose client reads nothing for this long is ended
WEBSOCKET_IDLE_TIMEOUT_S = 300.0   # a Responses WebSocket that sends no message for this long is closed
STREAM_HIGH_WATER = 64    # a stream's events waiting to be sent before its sequence is paused...
STREAM_LOW_WATER = 8      # ...and resumed


class RunningRequests(set[api.Request]):
    """The requests being answered; at shutdown, those still running past the drain time are ended with
    an error, so each stream closes with the spec's in-stream error (and [DONE]) instead of being cut."""

    def abort_all(self) -> None:
        error = server_error("the server is shutting down; retry the request", code="shutting_down", status=503)
        for handle in list(self):
            handle.cancel(error)


def create_app(models: ModelSet, *, api_key: str | None = None,
               on_load_failure: Callable[[str], None] = lambda reason: None,
               max_body_bytes: int = MAX_BODY_BYTES, allowed_hosts: list[str] | None = None,
               cors_origins: list[str] | None = None, stall_timeout: float = STALL_TIMEOUT_S,
               websocket_idle_timeout: float = WEBSOCKET_IDLE_TIMEOUT_S) -> Starlette:
    """The lse-server app over ``models``. With one model, it opens at startup, in the background, and a
    failure calls ``on_load_failure`` with the one-line reason (lse-server exits 1 from there); with several,
    each opens when first asked for. ``allowed_hosts``: the Host names answered (None: any); ``cors_origins``:
    the origins whose pages may call the API (none by default, so the browser refuses every other site's
    page; see lse_http.browser); ``stall_timeout``: how long a stream may stay paused because its client
    reads nothing (StreamEvents); ``websocket_idle_timeout``: how long a Responses WebSocket may send no message
    while no response runs."""

    from lse_http.ollama import routes as ollama_routes  # it builds on this module's transport

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if len(models.ids) == 1:
            app.state.starting = models.load(models.ids[0])
            app.state.starting.add_done_callback(functools.partial(_started, on_load_failure))
        yield
        await run_in_threadpool(models.close)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_socket),
        Route("/v1/responses/compact", compact_responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/lse/model_info", model_info, methods=["GET"]),
        Route("/v1/lse/status", status, methods=["GET"]),
        Route("/v1/lse/models/{model_id:path}/load", load_model, methods=["POST"]),
        Route("/v1/lse/models/{model_id:path}/unload", unload_model, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *ollama_routes(),
        Route("/", page, methods=["GET"]),
        Mount("/page", StaticFiles(directory=PAGE_DIR), name="page"),
    ]
    app = Starlette(routes=routes, exception_handlers=ERROR_HANDLERS, lifespan=lifespan)
    app.state.models = models
    app.state.starting = None   # the startup open of a one-model server, until it is done
    app.state.max_body_bytes = max_body_bytes
    app.state.running = RunningRequests()
    app.state.stall_timeout = stall_timeout
    app.state.websocket_idle_timeout = websocket_idle_timeout
    app.state.cors_origins = cors_origins or []   # the pages that may also open the Responses WebSocket
    # the last added runs first: the Host check, then CORS (a preflight carries no API key), then the key
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, hosts=allowed_hosts, render_error=_error)
    return app


# ---- the completion endpoints ----

async def chat_completions(request: Request) -> Response:
    return await _complete(request, functools.partial(api.lse_request, endpoint="chat"))


async def completions(request: Request) -> Response:
    return await _complete(request, functools.partial(api.lse_request, endpoint="completion"))


async def responses(request: Request) -> Response:
    return await _complete(request, functools.partial(api.lse_api_request, api="responses"), _responses_sse)


async def compact_responses(request: Request) -> Response:
    return await _complete(request, functools.partial(api.lse_api_request, api="responses_compact"))


async def stored_response(request: Request) -> Response:
    store, response_id = _models(request).responses, request.path_params["response_id"]
    if request.method == "DELETE":
        return _json(store.delete(response_id))
    return _json(store.response(response_id))


async def messages(request: Request) -> Response:
    return await _complete(request, functools.partial(api.lse_api_request, api="messages"), _typed_sse)


async def embeddings(request: Request) -> Response:
    body = await _read_json(request)
    with await _lease(request, body) as lse:
        return await json_in_thread(request, functools.partial(_embeddings_json, lse, body))


async def json_in_thread(request: Request, build: Callable[[threading.Event], bytes]) -> Response:
    """The JSON answer ``build`` makes in a worker thread (the vectors of /v1/embeddings and lse_http.ollama's
    /api/embed); a client that goes first sets the event ``build`` was given, which cancels its work."""
    cancel = threading.Event()
    work = asyncio.ensure_future(run_in_threadpool(build, cancel))
    gone = asyncio.ensure_future(_disconnected(request.receive))
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        cancel.set()
        with contextlib.suppress(LSEError):
            await work
        return _client_gone(request)
    return Response(work.result(), media_type="application/json")


async def count_tokens(request: Request) -> Response:
    body = await _read_json(request)
    with await _lease(request, body) as lse:
        return _json(await run_in_threadpool(api.lse_count_tokens, lse, body))


StartRequest = Callable[[api.LSE, Any, Callable[[api.Event], None]], api.Request]
StreamWriter = Callable[[api.Event, "StreamEvents"], AsyncIterator[bytes]]   # a stream's bytes from its events


async def _complete(request: Request, start: StartRequest, writer: StreamWriter | None = None) -> Response:
    """Start the request on the engine; answer with its JSON, or stream its events as SSE: OpenAI's chat
    chunks as ``data:`` lines ending in [DONE], or the typed events of the Responses and Messages APIs
    (``writer``).

    A stream's response starts only at the first event, so an error found before any token (a bad
    field, a prompt that fills the context, a full queue) keeps its own HTTP status; a request that failed
    (500: CPU fallback refused) is an error in its stream all the same (api.error_in_stream)."""
    body = await _read_json(request)
    stream = isinstance(body, dict) and body.get("stream") is True
    return await answer(request, body, start, stream, writer or _sse)


async def answer(request: Request, body: Any, start: StartRequest, stream: bool, writer: StreamWriter,
                 media_type: str = "text/event-stream") -> Response:
    """_complete's answer to a body already read, its stream written by ``writer`` (lse_http.ollama's too)."""
    handle, events = await _start(request, body, start, tokens=stream)
    running: RunningRequests = request.app.state.running
    try:
        first = await _event_unless_disconnected(request, events)
    except BaseException:
        running.discard(handle)
        raise
    if first is None or first.kind == api.EVENT_ERROR or not stream:
        running.discard(handle)
    if first is None:
        handle.cancel()
        return _client_gone(request)
    if first.kind == api.EVENT_ERROR and not (stream and api.error_in_stream(first.status)):
        return _json(first.data, first.status, _retry_after(first.status))   # the engine's queue full is a 503 too
    if not stream:
        return _json(first.data)
    return EventStream(writer(first, events), events, handle, media_type, on_close=running.discard)


async def _start(connection: HTTPConnection, body: Any, start: StartRequest,
                 tokens: bool = True) -> tuple[api.Request, StreamEvents]:
    """Lease the body's model and start the request on the engine, counted among the running ones: its
    handle, and its events as they arrive (token events only when ``tokens``). The lease ends with the request."""
    lease = await _lease(connection, body)
    loop = asyncio.get_running_loop()
    events = StreamEvents(connection.app.state.stall_timeout)

    def on_event(event: api.Event) -> None:   # called on the engine's thread
        if tokens or event.kind != api.EVENT_TOKEN:
            loop.call_soon_threadsafe(events.put, event)

    # lse_request renders and tokenizes the prompt: work for a thread, not the event loop
    try:
        handle = await run_in_threadpool(start, lease.lse, body, lease.until_end(on_event))
    except BaseException:
        lease.release()
        raise
    events.handle = handle
    connection.app.state.running.add(handle)
    return handle, events


class StreamEvents:
    """A request's events on their way to its client, bounded. When the client stops reading, sends wait
    (the socket's buffers are full) and events queue up: past STREAM_HIGH_WATER the sequence is paused
    (it stops decoding and keeps its KV slot), and it resumes once the client has read them down to
    STREAM_LOW_WATER. A pause that lasts ``stall_timeout`` seconds ends the request and ``on_stall`` (the
    response's abort), so a client that never reads holds neither a slot nor more memory. Used on the loop."""

    def __init__(self, stall_timeout: float) -> None:
        self.queue: asyncio.Queue[api.Event] = asyncio.Queue()
        self.stall_timeout = stall_timeout
        self.handle: api.Request | None = None
        self.on_stall: Callable[[], None] = lambda: None
        self._stall_timer: asyncio.TimerHandle | None = None

    def put(self, event: api.Event) -> None:
        self.queue.put_nowait(event)
        if self.handle is not None and self._stall_timer is None and self.queue.qsize() >= STREAM_HIGH_WATER:
            self.handle.pause()
            self._stall_timer = asyncio.get_running_loop().call_later(self.stall_timeout, self._stalled)

    async def get(self) -> api.Event:
        event = await self.queue.get()
        if self._stall_timer is not None and self.queue.qsize() <= STREAM_LOW_WATER:
            self._stall_timer.cancel()
            self._stall_timer = None
            self.handle.pause(False)
        return event

    def _stalled(self) -> None:
        log.warning("lse: a stream's client read nothing for %.0f s; ending its request", self.stall_timeout)
        self.handle.cancel(LSEError(f"the client read nothing for {self.stall_timeout:g} s", status=408,
                                    code="client_stalled"))
        self.on_stall()


async def _event_unless_disconnected(request: Request, events: StreamEvents) -> api.Event | None:
    """The next event, or None when the client disconnects first."""
    next_event = asyncio.ensure_future(events.get())
    disconnect = asyncio.ensure_future(_disconnected(request.receive))
    done, _ = await asyncio.wait((next_event, disconnect), return_when=asyncio.FIRST_COMPLETED)
    for task in (next_event, disconnect):
        task.cancel()
    return next_event.result() if next_event in done else None


async def _disconnected(receive: Receive) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A request's stream: server-sent events, or Ollama's lines of JSON (``body``, written from ``events``).
    However the response ends (the last chunk sent, or starlette cancelling it within a millisecond of the
    client closing, even before the first chunk), the request is cancelled; that is a no-op for a request
    that has already ended."""

    def __init__(self, body: AsyncIterator[bytes], events: StreamEvents, handle: api.Request,
                 media_type: str = "text/event-stream",
                 on_close: Callable[[api.Request], None] = lambda handle: None) -> None:
        super().__init__(body, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with anyio.CancelScope() as response:
                # a stalled client: stop waiting on its socket (the server then closes the connection)
                self.events.on_stall = response.cancel
                await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()
            self.on_close(self.handle)


async def _sse(event: api.Event, events: StreamEvents) -> AsyncIterator[bytes]:
    """``data: {...}`` per chunk, then ``data: [DONE]``; an error after the first event is sent in
    the stream, in the same shape as an error response."""
    while event.kind == api.EVENT_TOKEN:
        yield _sse_event(event.data)
        event = await events.get()
    for chunk in closing_events(event):
        yield _sse_event(chunk)
    yield SSE_DONE


def closing_events(event: api.Event) -> list[Any]:
    """The events that end a stream: an end's closing events, or its error's (one event, or the Responses API's
    error and response.failed)."""
    return event.data if isinstance(event.data, list) else [event.data]


def _sse_event(data: Any) -> bytes:
    return b"data: " + _dumps(data) + b"\n\n"


async def _typed_sse(event: api.Event, events: StreamEvents) -> AsyncIterator[bytes]:
    """Each stream event, then the closing ones (or the error's); the Messages API sends no [DONE]."""
    while event.kind == api.EVENT_TOKEN:
        yield _typed_sse_event(event.data)
        event = await events.get()
    for data in closing_events(event):
        yield _typed_sse_event(data)


async def _responses_sse(event: api.Event, events: StreamEvents) -> AsyncIterator[bytes]:
    """The typed events, then ``data: [DONE]``: Open Responses makes it a stream's terminal event."""
    async for chunk in _typed_sse(event, events):
        yield chunk
    yield SSE_DONE


def _typed_sse_event(data: dict[str, Any]) -> bytes:
    """``event: <type>`` and its ``data:``, as the Responses and Messages APIs stream."""
    return b"event: " + data["type"].encode() + b"\ndata: " + _dumps(data) + b"\n\n"


def stream_error_bytes(path: str, error: LSEError, events_sent: int) -> bytes:
    """The bytes that end a stream on ``path`` whose request failed after ``events_sent`` events, written as the
    engine's own in-stream errors are (lse_ray's ingress, when the replica serving it is lost)."""
    api_name = _api_of(path)
    event = api.lse_stream_error(error, api_name, events_sent)
    if api_name == "chat":
        return _sse_event(event) + SSE_DONE
    return _typed_sse_event(event) + (SSE_DONE if api_name == "responses" else b"")


def _api_of(path: str) -> str:
    """Whose shapes a path's bodies and errors take: "messages", "responses" or OpenAI's ("chat")."""
    if path.startswith("/v1/messages"):
        return "messages"
    return "responses" if path.startswith("/v1/responses") else "chat"


# ---- the Responses API over a WebSocket ----

async def responses_socket(websocket: WebSocket) -> None:
    """The Responses API's WebSocket mode: each ``response.create`` message (a /v1/responses body with its
    ``type``, without ``stream`` or ``background``) runs one response, whose stream events come back as messages,
    as SSE would carry them; the next message waits for it. A message refused before its response's first event
    is answered with an ``error`` message carrying its HTTP status, and the connection stays open. Closing the
    connection cancels the response running; one that sends no message for the idle timeout while none runs is
    closed (1000), so a silent client holds no socket."""
    if not _origin_allowed(websocket):
        error = LSEError(f"a page from {websocket.headers['origin']!r:.200} may not open this WebSocket; start "
                         "lse-server with --cors-origins to allow it", status=403, type="permission_error",
                         code="origin_not_allowed")
        await websocket.send_denial_response(_error(websocket.url.path, error))
        return
    await websocket.accept()
    messages: asyncio.Queue[str | None] = asyncio.Queue()
    closed = asyncio.Event()
    reader = asyncio.ensure_future(_read_messages(websocket, messages, closed))
    idle_timeout = websocket.app.state.websocket_idle_timeout
    try:
        while not closed.is_set():
            try:
                message = await asyncio.wait_for(messages.get(), idle_timeout)
            except TimeoutError:
                log.info("lse: closing a Responses WebSocket that sent no message in %g s", idle_timeout)
                await websocket.close(1000, f"no message for {idle_timeout:g} s")
                return
            if message is None:
                return
            try:
                await _socket_response(websocket, message, closed)
            except LSEError as e:
                await _send(websocket, responses_api.websocket_error_event(e.body(), e.status))
    except WebSocketDisconnect:   # it closed while a message was on its way
        pass
    finally:
        reader.cancel()


def _origin_allowed(websocket: WebSocket) -> bool:
    """Browsers let a page of any site open a WebSocket to the server (CORS does not apply), and say which site
    in ``Origin``: the server's own pages (the Origin's host is the Host) and --cors-origins' may. Clients that
    are not browsers send no Origin."""
    origin = websocket.headers.get("origin")
    return (origin is None or origin in websocket.app.state.cors_origins
            or origin.partition("://")[2].lower() == websocket.headers.get("host", "").lower())


async def _read_messages(websocket: WebSocket, messages: asyncio.Queue[str | None], closed: asyncio.Event) -> None:
    """Each message the client sends as text, then None, and ``closed`` set, once it closes the connection."""
    try:
        while (message := await websocket.receive())["type"] != "websocket.disconnect":
            text = message.get("text")
            messages.put_nowait(text if text is not None else message.get("bytes", b"").decode(errors="replace"))
    finally:
        closed.set()
        messages.put_nowait(None)


async def _socket_response(websocket: WebSocket, message: str, closed: asyncio.Event) -> None:
    """Run one ``response.create`` message and send its events; raises LSEError when it is refused. A client
    that reads nothing for the stall timeout has its response ended and ``closed`` set: the handler returns, and
    the server closes the connection."""
    limit = websocket.app.state.max_body_bytes
    if len(message.encode()) > limit:
        raise _too_large(limit)
    body = responses_api.websocket_body(message)
    handle, events = await _start(websocket, body, functools.partial(api.lse_api_request, api="responses"))
    running: RunningRequests = websocket.app.state.running
    try:
        with anyio.CancelScope() as stalled:
            events.on_stall = stalled.cancel   # a client that reads nothing: stop sending, and close
            while (event := await _event_unless_closed(events, closed)) is not None:
                # refused before its stream: an error body (a failed stream's events come as a list)
                if event.kind == api.EVENT_ERROR and not isinstance(event.data, list):
                    await _send(websocket, responses_api.websocket_error_event(event.data, event.status))
                    return
                for data in closing_events(event):
                    await _send(websocket, data)
                if event.kind != api.EVENT_TOKEN:
                    return
        closed.set()
    finally:
        handle.cancel()
        running.discard(handle)


async def _event_unless_closed(events: StreamEvents, closed: asyncio.Event) -> api.Event | None:
    """The next event, or None once the connection is closed."""
    next_event, gone = asyncio.ensure_future(events.get()), asyncio.ensure_future(closed.wait())
    done, _ = await asyncio.wait((next_event, gone), return_when=asyncio.FIRST_COMPLETED)
    for task in (next_event, gone):
        task.cancel()
    return next_event.result() if next_event in done else None


async def _send(websocket: WebSocket, data: dict[str, Any]) -> None:
    await websocket.send_text(_dumps(data).decode())


# ---- models, status, health ----

async def list_models(request: Request) -> Response:
    return _json(api.model_list(_models(request).entries(), _models_api(request)))


async def get_model(request: Request) -> Response:
    return _json(_models(request).entry(request.path_params["model_id"]))


async def load_model(request: Request) -> Response:
    """Open the model now (again, after it failed) and answer its entry once it is open."""
    _object(await _read_json(request))   # JSON only: a page elsewhere may not post here (lse_http.browser)
    return _json(await asyncio.wrap_future(_models(request).load(request.path_params["model_id"])))


async def unload_model(request: Request) -> Response:
    """Close the model now (409 while it has requests running) and answer its entry."""
    _object(await _read_json(request))
    return _json(await run_in_threadpool(_models(request).unload, request.path_params["model_id"]))


def _models_api(request: Request) -> str:
    """Whose /v1/models shape the client reads: Anthropic's clients send anthropic-version."""
    return "messages" if "anthropic-version" in request.headers else "chat"


async def model_info(request: Request) -> Response:
    """lse_model_info of ``?model=ID`` (the default model without it), opened if it is not."""
    with await _lease(request, {"model": request.query_params.get("model")}) as lse:
        return _json(api.lse_model_info(lse))


async def status(request: Request) -> Response:
    """lse_status of ``?model=ID`` (the default model without it) and every model's, under ``models``."""
    return _json(_models(request).status(request.query_params.get("model")))


async def health(request: Request) -> Response:
    loading = _starting(request)
    return _json(health_body(loading), 503 if loading else 200)


async def metrics(request: Request) -> Response:
    models = _models(request)
    text = prometheus_text(models.engines(), time.time() - models.started)
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def openapi(request: Request) -> Response:
    bounds = request.app.state.models.vocabulary_bounds()   # before a model opens, token ids are not bounded
    return _json(OPENAPI if bounds is None else served_document(*bounds))


async def page(request: Request) -> Response:
    return FileResponse(PAGE_DIR / "index.html", headers={"Content-Security-Policy": PAGE_CSP})


# ---- tokenizer ----

async def tokenize(request: Request) -> Response:
    """llama.cpp's {"content"} or vLLM's {"prompt"} / {"messages"} -> {"tokens", "count", "max_model_len"}."""
    body = await _read_json(request)
    with await _lease(request, body) as lse:
        return _json(await run_in_threadpool(api.lse_tokenize, lse, body))


async def detokenize(request: Request) -> Response:
    """{"tokens": [int...]} -> {"content": str}."""
    body = await _read_json(request)
    with await _lease(request, body) as lse:
        tokenizer = lse.model.tokenizer
        tokens = parse_detokenize(body, tokenizer.vocab_size)
        return _json(detokenized(await run_in_threadpool(tokenizer.decode, tokens)))


# ---- bodies, errors, auth ----

async def _read_json(request: Request) -> Any:
    """The body as JSON; 415 unless it is declared application/json, 413 as soon as it is known to exceed
    the limit, 400 invalid_json."""
    _check_json_media_type(request.headers.get("content-type", ""))
    limit = request.app.state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise invalid_request(f"the request body is not valid JSON: {e}", "invalid_json") from None


def _check_json_media_type(content_type: str) -> None:
    """Only JSON: text/plain, form and untyped bodies are what any web page may send to a local server
    without a CORS preflight (lse_http.browser)."""
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "application/json":
        given = f"Content-Type {media_type!r}" if media_type else "no Content-Type"
        raise LSEError(f"the request body must be JSON sent with Content-Type: application/json; got {given}",
                       status=415, code="unsupported_media_type")


def _too_large(limit: int) -> LSEError:
    return LSEError(f"the request body is larger than {limit} bytes", status=413, code="body_too_large")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object", "invalid_type")
    return body


def _started(on_failure: Callable[[str], None], opened: Future[dict[str, Any]]) -> None:
    """A one-model server's startup open is done: log it, or report its failure."""
    if opened.exception() is not None:
        on_failure(str(opened.exception()))
    else:
        log.info("lse: serving %s (context %d tokens)", opened.result()["id"], opened.result()["context_length"])


def _starting(request: Request) -> bool:
    starting = request.app.state.starting
    return starting is not None and not starting.done()


def _models(request: Request) -> ModelSet:
    if _starting(request):
        raise server_error("the model is still loading; retry when /health answers 200", code="loading",
                           status=503)
    return request.app.state.models


async def _lease(request: HTTPConnection, body: Any) -> Lease:
    """The model the body names, leased for this request: the one place a request's model is resolved. It
    waits while the model opens; a client that leaves meanwhile gives the lease back once it is granted."""
    future = _models(request).lease(requested_model(body))
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().release())
        raise


def _dumps(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _embeddings_json(lse: api.LSE, body: Any, cancel: threading.Event) -> bytes:
    return dumps_by_item(api.lse_embeddings(lse, body, cancel), "data")


def dumps_by_item(answer: dict[str, Any], key: str) -> bytes:
    """``answer`` as JSON, its list under ``key`` (written last) dumped an item at a time: one dump of thousands
    of vectors would hold the GIL, and with it the engine and every stream, for a second or more."""
    items = b",".join([_dumps(item) for item in answer.pop(key)])
    head = _dumps(answer)[:-1]
    return head + (b"," if answer else b"") + _dumps(key) + b":[" + items + b"]}"


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(data), status, headers, media_type="application/json")


def _error(path: str, error: LSEError, headers: dict[str, str] | None = None) -> Response:
    """An error in the shape of the API the path belongs to (Anthropic's under /v1/messages, Ollama's under /api/)."""
    shape = "messages" if path.startswith("/v1/messages") else "ollama" if path.startswith("/api/") else "chat"
    return _json(api.lse_error_body(error, shape), error.status, headers)


async def _lse_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, LSEError)
    return _error(request.url.path, e, _retry_after(e.status))


def _retry_after(status: int) -> dict[str, str] | None:
    """A 503 (loading, a full queue, shutting down) tells the client when to try again."""
    return {"Retry-After": "1"} if status == 503 else None


async def _http_error(request: Request, e: Exception) -> Response:
    """Starlette's 404 (no route) and 405 (wrong method) in the API's error shape."""
    assert isinstance(e, HTTPException)
    if e.status_code == 404:
        error = LSEError(f"no route {request.method} {request.url.path}", status=404, code="not_found")
    elif e.status_code == 405:
        error = LSEError(f"{request.url.path} does not accept {request.method}; it accepts "
                         f"{(e.headers or {}).get('Allow', 'other methods')}", status=405, code="method_not_allowed")
    else:
        error = LSEError(str(e.detail), status=e.status_code, code="http_error")
    return _error(request.url.path, error, e.headers)


def _client_gone(request: Request) -> Response:
    """The answer to a client that closed its connection before it (nobody reads the 499). A disconnect is
    normal: one info line, no traceback."""
    log.info("lse: the client of %s %s closed the connection before its answer", request.method, request.url.path)
    return Response(status_code=499)


async def _client_disconnect(request: Request, e: Exception) -> Response:
    """The client closed the connection while its body was being read."""
    return _client_gone(request)


async def _internal_error(request: Request, e: Exception) -> Response:
    """Any other exception: a 500 in the error shape (uvicorn logs the traceback)."""
    return _error(request.url.path, server_error(f"internal error: {type(e).__name__}: {e}"))


# every error a route raises, answered in its API's error shape (lse_ray's ingress answers its own with these too)
ERROR_HANDLERS = {LSEError: _lse_error, HTTPException: _http_error, ClientDisconnect: _client_disconnect,
                  Exception: _internal_error}


def _open(path: str) -> bool:
    """Whether the path is answered without the API key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's) on every
    path but /health and the page's; 401 authentication_error otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not _open(scope["path"]):   # a refused WebSocket gets the 401
            given = _presented_key(Headers(scope=scope))
            if not hmac.compare_digest(given, self.expected):
                problem = "is missing" if not given else "is not this server's key"
                error = LSEError(f"the API key {problem}; send Authorization: Bearer <key> or x-api-key: <key>",
                                 status=401, type="authentication_error", code="invalid_api_key")
                await _error(scope["path"], error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _presented_key(headers: Headers) -> bytes:
    """The key a request presents: Authorization's credentials when its scheme is Bearer, in any case and with
    any spaces around (RFC 7235), else x-api-key's; empty when it presents none. Headers arrive as latin-1:
    encoding them back gives the bytes sent."""
    if "authorization" in headers:
        scheme, _, credentials = headers["authorization"].strip().partition(" ")
        return credentials.strip().encode("latin-1") if scheme.lower() == "bearer" else b""
    return headers.get("x-api-key", "").strip().encode("latin-1")
