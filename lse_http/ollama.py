"""Ollama's API under /api/: the routes, over lse_core.adapters.ollama and the OpenAI endpoints' transport
(lse_http.app). Ollama streams unless ``stream`` is false, as lines of JSON (application/x-ndjson), and a
request's ``keep_alive`` sets how long its model stays loaded once idle (lse_core.model_set). An empty request
(no messages, no prompt) only loads its model, or with keep_alive 0 unloads it, as Ollama's do. Models are
the files lse-server was given: /api/pull and the other model management answer 501."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import AsyncIterator
from importlib.metadata import version
from typing import Any, Literal

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lse_core import api
from lse_core.adapters import ollama
from lse_core.model_set import ModelSet, requested_model
from lse_http.app import (
    StreamEvents,
    _dumps,
    _json,
    _lease,
    _models,
    _read_json,
    answer,
    closing_events,
    dumps_by_item,
    json_in_thread,
)

NDJSON = "application/x-ndjson"


async def chat(request: Request) -> Response:
    return await _generate(request, "chat")


async def generate(request: Request) -> Response:
    return await _generate(request, "generate")


async def _generate(request: Request, endpoint: Literal["chat", "generate"]) -> Response:
    body = await _read_json(request)
    keep_alive = ollama.keep_alive(body)
    if ollama.loads_only(body, endpoint):
        with await _lease(request, body) as lse:
            model_id = lse.model_id
        unloading = keep_alive == 0
        _keep_alive(request, model_id, keep_alive)
        return _json(ollama.load_response(endpoint, model_id, unloading))
    stream = isinstance(body, dict) and body.get("stream") is not False
    start = functools.partial(api.lse_api_request, api=f"ollama_{endpoint}")
    response = await answer(request, body, start, stream, _ndjson, NDJSON)
    if response.status_code == 200:
        _keep_alive(request, requested_model(body), keep_alive)
    return response


def _keep_alive(request: Request, model: str | None, seconds: float | None) -> None:
    if seconds is not None:
        _models(request).keep_alive(model, seconds)


async def _ndjson(event: api.Event, events: StreamEvents) -> AsyncIterator[bytes]:
    """Each object on its own line, then the last one (or the error object)."""
    while event.kind == api.EVENT_TOKEN:
        yield _dumps(event.data) + b"\n"
        event = await events.get()
    for data in closing_events(event):
        yield _dumps(data) + b"\n"


async def embed(request: Request) -> Response:
    """/api/embed, and the legacy /api/embeddings (one prompt, one vector), answered as /v1/embeddings is: made in
    a worker thread, and cancelled when the client goes."""
    body = await _read_json(request)
    legacy = request.url.path == "/api/embeddings"
    keep_alive = ollama.keep_alive(body)
    start = time.monotonic_ns()
    with await _lease(request, body) as lse:
        response = await json_in_thread(request, functools.partial(_embed_json, lse, body, legacy, start))
        model_id = lse.model_id
    if response.status_code == 200:
        _keep_alive(request, model_id, keep_alive)
    return response


def _embed_json(lse: api.LSE, body: Any, legacy: bool, start_ns: int, cancel: threading.Event) -> bytes:
    vectors_body, warnings = ollama.embeddings_body(body, legacy, lse.context_length)
    if legacy:
        empty = not vectors_body["input"]   # an empty prompt gets no vector, as Ollama answers it
        return _dumps(ollama.embedding_response(None if empty else api.lse_embeddings(lse, vectors_body, cancel)))
    vectors = api.lse_embeddings(lse, vectors_body, cancel)
    return dumps_by_item(ollama.embed_response(vectors, lse.model_id, start_ns, warnings), "embeddings")


def _listed(models: ModelSet) -> list[tuple[ollama.ListedModel, str | None, api.LSE | None]]:
    """Each model's /api/tags entry, with its path and, while it is loaded, its LSE handle."""
    loaded = {model_id: lse for model_id, _, lse in models.engines()}
    listed = []
    for spec in models.specs:
        lse = loaded[spec.id]
        path = spec.path or (lse.model.source if lse is not None else None)
        listed.append((ollama.listed_model(spec.id, path, lse), path, lse))
    return listed


async def tags(request: Request) -> Response:
    listed = await run_in_threadpool(_listed, _models(request))
    return _json(ollama.OllamaModelList(models=[entry for entry, _, _ in listed]))


async def running(request: Request) -> Response:
    models = _models(request)
    listed = await run_in_threadpool(_listed, models)
    states = {status["model"]: status for status in models.status()["models"]}
    entries = []
    for entry, _, lse in listed:
        state = states[entry["name"]]
        if lse is None or state["state"] != "loaded":
            continue
        limit = models.idle_limit(entry["name"])
        expires_in = None if limit is None else limit - (state["idle_s"] or 0.0)
        entries.append(ollama.running_model(entry, lse, state["memory_bytes"] or 0, expires_in))
    return _json(ollama.RunningList(models=entries))


async def show(request: Request) -> Response:
    """/api/show: the model, loaded if it is not (its details need it open)."""
    body = await _read_json(request)
    named = ollama.show_model(body)
    with await _lease(request, {"model": named}) as lse:
        model_id = lse.model_id
        entry, path, _ = next(item for item in await run_in_threadpool(_listed, _models(request))
                              if item[0]["name"] == model_id)
        return _json(ollama.show(entry, path, lse))


async def ollama_version(request: Request) -> Response:
    return _json(ollama.version(version("lse")))


async def model_management(request: Request) -> Response:
    raise ollama.model_management_error(request.url.path.removeprefix("/api/"))


def routes() -> list[Route]:
    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embed, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/ps", running, methods=["GET"]),
        Route("/api/version", ollama_version, methods=["GET"]),
        *(Route(f"/api/{action}", model_management, methods=["DELETE" if action == "delete" else "POST"])
          for action in ollama.MODEL_MANAGEMENT),
    ]
