"""The OpenAPI 3.1 document served at /openapi.json. Every request body's schema comes from the pydantic
model that checks it (lse_core.adapters), and so do the replies and reply parts declared as the pydantic types
or TypedDicts that build them (REPLY_TYPES: chat and text completions and their chunks, usage, timings,
lse_context, lse_warnings entries, /tokenize's and /detokenize's answers, the error body, /v1/models and its
entries, count_tokens, embeddings, CPU-fallback counters, /health, /v1/lse/model_info and /v1/lse/status; the
Responses API's response, its stream events and DELETE's answer; the Messages API's message, its stream events
and its error body; Ollama's requests, replies, stream lines and error body under /api/). The schemas written
here are the error responses and the paths. Its schemas are JSON Schema
2020-12; the server tests validate real responses against them.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import TypeAdapter

from lse_core import api, model_set, protocol
from lse_core.adapters import anthropic, ollama, responses
from lse_core.adapters.anthropic import CountTokensRequest, MessagesRequest
from lse_core.adapters.common import TOKEN_ID_MARK, WIDTH_MARK
from lse_core.adapters.openai import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeBody
from lse_core.adapters.responses import CompactRequest, ResponsesRequest
from lse_core.embeddings import EmbeddingList, EmbeddingsRequest
from lse_core.errors import Error
from lse_core.fallback import CPUFallback
from lse_core.limits import LSEContext
from lse_core.sampling import GenerationDefaults
from lse_core.template.thinking import Thinking


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: list[str], properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, **more}


def sse(event: dict[str, Any], done: bool = False) -> dict[str, Any]:
    """A text/event-stream body, described per event (schemathesis and OpenAPI 3.2 read it so): ``data``
    is the JSON text of ``event``, or (``done``) that or the closing [DONE]."""
    data = {"type": "string", "description": "the JSON text of an event, or [DONE]"} if done else {
        "type": "string", "contentMediaType": "application/json", "contentSchema": event}
    return {"schema": obj(["data"], {"event": STRING, "id": STRING, "data": data})}


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


STRING = {"type": "string"}
ERROR_STATUSES = (400, 401, 403, 404, 413, 415, 500, 503)
ERRORS = {str(status): {"$ref": f"#/components/responses/Error{status}"} for status in ERROR_STATUSES}


# the replies and reply parts declared as pydantic types or TypedDicts, whose schemas are taken as they
# serialize; a stream's events are a named union alias (TypeAliasType), which pydantic makes a component of
REPLY_TYPES = (protocol.Usage, protocol.Timings, protocol.LSEWarning, LSEContext, protocol.Tokenized,
               protocol.Content, Error, protocol.Model, protocol.ModelList, protocol.TokenCount,
               protocol.Health, EmbeddingList, CPUFallback, protocol.ChatCompletion, protocol.ChatCompletionChunk,
               protocol.TextCompletion, protocol.TextCompletionChunk, responses.Response, responses.ResponseStreamEvent,
               responses.DeletedResponse, responses.Compaction, anthropic.Message, anthropic.MessageStreamEvent,
               anthropic.AnthropicError, Thinking, GenerationDefaults, api.Device, api.ModelInfo, model_set.Status,
               ollama.ChatResponse, ollama.ChatPart, ollama.GenerateResponse, ollama.GeneratePart, ollama.LoadResponse,
               ollama.EmbedResponse, ollama.EmbeddingResponse, ollama.OllamaModelList, ollama.RunningList,
               ollama.ShowResponse, ollama.Version, ollama.OllamaError)


def model_schemas() -> dict[str, Any]:
    """Every request body as the pydantic model that checks it declares it, and the replies and reply parts
    built from pydantic types (REPLY_TYPES) as they serialize."""
    requests = (ChatCompletionRequest, CompletionRequest, TokenizeBody, DetokenizeRequest, ResponsesRequest,
                CompactRequest, MessagesRequest, CountTokensRequest, EmbeddingsRequest, ollama.ChatRequest,
                ollama.GenerateRequest, ollama.EmbedRequest, ollama.OllamaEmbeddingsRequest, ollama.ShowRequest)
    inputs = [(m, "validation", TypeAdapter(m)) for m in requests] + [
        (m, "serialization", TypeAdapter(m)) for m in REPLY_TYPES]   # TypeAdapter: TypedDicts as well as models
    _, schema = TypeAdapter.json_schemas(inputs, ref_template="#/components/schemas/{model}")
    return schema["$defs"]


ERROR_TEXT = {400: "invalid request (invalid_json, invalid_type, invalid_value, missing_field, context_full, "
                   "thinking errors...)",
              401: "missing or wrong API key (authentication_error, invalid_api_key)",
              403: "bound to loopback, the Host header names another host (host_not_allowed)",
              404: "no such route or model", 413: "request body over 8 MiB",
              415: "the body is not sent as Content-Type: application/json (unsupported_media_type)",
              500: "server_error: an engine failure, CPU fallback disabled: <group>, or the model failed to load "
                   "(model_load_failed)",
              503: "the model is loading, or the request queue (or a model's queue while it loads) is full"}


def completion_path(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": f"a {response}, or with stream: true server-sent events: `data: <{chunk}>` "
                                   "lines, `data: <Error>` if the request fails after streaming began, then "
                                   "`data: [DONE]`",
                    "content": {"application/json": {"schema": ref(response)},
                                "text/event-stream": sse(ref(chunk), done=True)}},
            **ERRORS}}}


def typed_stream_path(summary: str, request: str, response: str, event: str, errors: dict[str, Any] = ERRORS,
                      failed: str = "an error event", done: bool = False) -> dict[str, Any]:
    """A path whose stream is typed events; one that fails after streaming began ends with ``failed``, and
    (``done``) every stream with `data: [DONE]`."""
    ending = ", then `data: [DONE]`" if done else ""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": f"a {response}, or with stream: true server-sent events `event: <type>` and "
                                   f"`data: <{event}>` (an error after streaming began is {failed}){ending}",
                    "content": {"application/json": {"schema": ref(response)},
                                "text/event-stream": sse(ref(event), done)}},
            **errors}}}


ANTHROPIC_ERRORS = {str(status): json_body(ref("AnthropicError"), text) for status, text in ERROR_TEXT.items()}
OLLAMA_ERRORS = {str(status): json_body(ref("OllamaError"), text) for status, text in ERROR_TEXT.items()}
NDJSON = "application/x-ndjson"


def ollama_generation(summary: str, request: str, reply: str, part: str) -> dict[str, Any]:
    """/api/chat or /api/generate: a reply (or, for a body with nothing to answer, the model's load), or by
    default lines of JSON: the parts, then the reply (or the error of a request that fails once streaming)."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": f"with stream: false a {reply} (a LoadResponse when the body asks for no "
                                   f"reply), else {NDJSON}: a {part} per line, then the {reply} (or an OllamaError)",
                    "content": {"application/json": {"schema": {"anyOf": [ref(reply), ref("LoadResponse")]}},
                                NDJSON: {"schema": {"anyOf": [ref(part), ref(reply), ref("OllamaError")]}}}},
            **OLLAMA_ERRORS}}}


def ollama_paths() -> dict[str, Any]:
    """Ollama's API under /api/ (lse_http.ollama), its errors in Ollama's shape; model management answers 501."""
    management = json_body(ref("OllamaError"), "not supported: LSE serves the model files given to lse-server")
    paths: dict[str, Any] = {
        "/api/chat": ollama_generation("Ollama's chat", "ChatRequest", "ChatResponse", "ChatPart"),
        "/api/generate": ollama_generation("Ollama's generate (raw: a completion of the prompt)",
                                           "GenerateRequest", "GenerateResponse", "GeneratePart"),
        "/api/embed": post("Ollama's embeddings of each input", "EmbedRequest", "EmbedResponse", OLLAMA_ERRORS),
        "/api/embeddings": post("Ollama's legacy embedding of one prompt", "OllamaEmbeddingsRequest",
                                "EmbeddingResponse", OLLAMA_ERRORS),
        "/api/show": post("Ollama's details of a model, loaded if it is not", "ShowRequest", "ShowResponse",
                          OLLAMA_ERRORS),
        "/api/tags": get("Ollama's list of the served models", "OllamaModelList", error_bodies=OLLAMA_ERRORS),
        "/api/ps": get("Ollama's list of the loaded models", "RunningList", error_bodies=OLLAMA_ERRORS),
        "/api/version": get("The Ollama version whose API this follows", "Version", error_bodies=OLLAMA_ERRORS),
    }
    for action in ollama.MODEL_MANAGEMENT:
        method = "delete" if action == "delete" else "post"
        paths[f"/api/{action}"] = {method: {"summary": f"Ollama's {action}: not supported", "responses": {
            "501": management, **{str(s): OLLAMA_ERRORS[str(s)] for s in (401, 403)}}}}
    return paths


GET_ERRORS = (401, 403, 500, 503)   # what any GET may answer besides 200 (a key, the Host, loading)


def get(summary: str, schema: str, *errors: int, media: str = "application/json",
        error_bodies: dict[str, Any] = ERRORS) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": summary, "content": {media: {"schema": ref(schema) if schema else STRING}}},
        **{str(s): error_bodies[str(s)] for s in sorted({*GET_ERRORS, *errors})}}}}


def post(summary: str, request: str, response: str, errors: dict[str, Any] = ERRORS) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
                     "responses": {"200": json_body(ref(response), summary), **errors}}}


MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": STRING}


def model_action(summary: str) -> dict[str, Any]:
    """POST /v1/lse/models/{id}/load or /unload: an empty JSON object in, the model's entry out."""
    busy = json_body(ref("Error"), "the model is loading, or has requests running (model_busy)")
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": obj([], {})}}},
                     "responses": {"200": json_body(ref("Model"), summary), **ERRORS, "409": busy}},
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": STRING}]}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "LSE", "version": "0.1.0",
             "description": "LSE's OpenAI-compatible API, with LSE's own fields (stop_reason, lse_context, "
                            "timings, lse_warnings, thinking levels, generation defaults)."},
    "components": {
        "schemas": model_schemas(),
        "responses": {f"Error{status}": json_body(ref("Error"), text) for status, text in ERROR_TEXT.items()},
        "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                       "description": "only when lse-server runs with --api-key"},
                            "anthropicKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                             "description": "the same key, as Anthropic's clients send it"}},
    },
    "security": [{}, {"apiKey": []}, {"anthropicKey": []}],
    "paths": {
        "/v1/chat/completions": completion_path("Chat completion", "ChatCompletionRequest", "ChatCompletion",
                                                "ChatCompletionChunk"),
        "/v1/completions": completion_path("Text completion", "CompletionRequest", "TextCompletion",
                                           "TextCompletionChunk"),
        "/v1/responses": typed_stream_path("OpenAI Responses", "ResponsesRequest", "Response",
                                           "ResponseStreamEvent", failed="an error event and response.failed",
                                           done=True),
        "/v1/responses/compact": post("Compact a conversation: its user messages and the model's summary of it, "
                                      "the next request's input", "CompactRequest", "Compaction"),
        "/v1/responses/{response_id}": {
            **get("A stored response (made with store, among the last 256)", "Response", 404),
            "delete": {"summary": "Forget a stored response", "responses": {
                "200": json_body(ref("DeletedResponse"), "deleted"),
                **{str(s): ERRORS[str(s)] for s in (*GET_ERRORS, 404)}}},
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": STRING}]},
        "/v1/messages": typed_stream_path("Anthropic Messages (errors in Anthropic's shape)", "MessagesRequest",
                                          "Message", "MessageStreamEvent", ANTHROPIC_ERRORS),
        "/v1/messages/count_tokens": post("The prompt tokens of a Messages conversation", "CountTokensRequest",
                                          "TokenCount", ANTHROPIC_ERRORS),
        "/v1/embeddings": post("Pooled, L2-normalized final hidden states of each input", "EmbeddingsRequest",
                               "EmbeddingList"),
        "/v1/models": get("The served models, each with its state", "ModelList", 503),
        "/v1/models/{model_id}": {**get("One model", "Model", 404, 503),
                                  "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                  "schema": STRING}]},
        "/v1/lse/model_info": {**get("lse_model_info of ?model (the default model without it), loaded if it is "
                                     "not", "ModelInfo", 404, 503), "parameters": [MODEL_QUERY]},
        "/v1/lse/status": {**get("lse_status of ?model (the default model without it), and each model's",
                                 "Status", 404, 503), "parameters": [MODEL_QUERY]},
        "/v1/lse/models/{model_id}/load": model_action("Load the model (again, after it failed); its entry once "
                                                       "loaded"),
        "/v1/lse/models/{model_id}/unload": model_action("Unload the model; its entry"),
        "/health": {"get": {"summary": "200 when the model is loaded, 503 while it loads", "security": [],
                            "responses": {"200": json_body(ref("Health"), "ready"),
                                          "503": json_body(ref("Health"), "loading")}}},
        "/": {"get": {"summary": "The chat page (its files under /page/), served without the API key",
                      "security": [], "responses": {"200": {"description": "the page",
                                                            "content": {"text/html": {"schema": STRING}}}}}},
        "/tokenize": post("Tokens of text, or of a completion's or chat's prompt", "TokenizeBody", "Tokenized"),
        "/detokenize": post("Text of token ids", "DetokenizeRequest", "Content"),
        "/metrics": get("Prometheus metrics", "", 503, media="text/plain"),
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": json_body({"type": "object"},
                                                                                            "OpenAPI 3.1")}}},
        **ollama_paths(),
    },
}


def served_document(vocab_size: int, hidden_size: int) -> dict[str, Any]:
    """The document for a served model: token ids bounded by its vocabulary, dimensions by its width."""
    document = copy.deepcopy(OPENAPI)
    bounds = {TOKEN_ID_MARK: vocab_size - 1, WIDTH_MARK: hidden_size}

    def bound(node: Any) -> None:
        if isinstance(node, dict):
            for mark, maximum in bounds.items():
                if node.get(mark):
                    node["maximum"] = maximum
            for value in node.values():
                bound(value)
        elif isinstance(node, list):
            for value in node:
                bound(value)

    bound(document)
    return document
