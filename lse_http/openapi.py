"""The OpenAPI 3.1 document served at /openapi.json, written by hand from spec/API.md and
lse_core/protocol.py; the request bodies of /v1/responses, /v1/messages and /v1/embeddings come from
the pydantic models that check them. Its schemas are JSON Schema 2020-12; the server tests validate real
responses against them, so a change to a shape must change this file too."""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from lse_core.adapters.anthropic import CountTokensRequest, MessagesRequest
from lse_core.adapters.common import TOKEN_ID_MARK, WIDTH_MARK
from lse_core.adapters.responses import ResponsesRequest
from lse_core.config import KV_CACHE_TYPES
from lse_core.embeddings import EmbeddingsRequest


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: list[str], properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, **more}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def exactly_one_of(fields: dict[str, Any], **more: Any) -> dict[str, Any]:
    """An object with exactly one of ``fields`` not null."""
    return {"oneOf": [obj([name], {other: schema if other == name else nullable(schema)
                                   for other, schema in fields.items()}) for name in fields], **more}


def sse(event: dict[str, Any], done: bool = False) -> dict[str, Any]:
    """A text/event-stream body, described per event (schemathesis and OpenAPI 3.2 read it so): ``data``
    is the JSON text of ``event``, or (``done``) that or the closing [DONE]."""
    data = {"type": "string", "description": "the JSON text of an event, or [DONE]"} if done else {
        "type": "string", "contentMediaType": "application/json", "contentSchema": event}
    return {"schema": obj(["data"], {"event": STRING, "id": STRING, "data": data})}


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


STRING, INTEGER, NUMBER, BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))
COUNT = {"type": "integer", "minimum": 0}
TOKEN_ID = {"type": "integer", "minimum": 0, TOKEN_ID_MARK: True}   # bounded by served_document
TOKEN_IDS = {"type": "array", "minItems": 1, "items": TOKEN_ID}
STOP_REASON = {"enum": ["stop_token", "stop_sequence", "max_tokens", "context_full", "cancelled"]}
FINISH_REASON = {"enum": ["stop", "length", "tool_calls", None]}
ERROR_STATUSES = (400, 401, 403, 404, 413, 415, 500, 503)
ERRORS = {str(status): {"$ref": f"#/components/responses/Error{status}"} for status in ERROR_STATUSES}

SAMPLING_FIELDS = {   # each may be null: null means not sent (spec/API.md)
    "model": {"type": "string", "description": "must name the served model when sent"},
    "stream": nullable(BOOLEAN),
    "stream_options": nullable(obj([], {"include_usage": nullable(BOOLEAN)})),
    "max_tokens": nullable({"type": "integer", "minimum": 1}),
    "max_completion_tokens": nullable({"type": "integer", "minimum": 1}),
    "stop": nullable({"anyOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}),
    "n": nullable({"const": 1}),
    "temperature": nullable(NUMBER),
    "top_k": nullable({"type": "integer", "minimum": -1}),
    "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "min_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "presence_penalty": nullable(NUMBER),
    "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0}),
    "frequency_penalty": nullable(NUMBER),
    "seed": nullable({"type": "integer", "minimum": 0}),
    "ignore_eos": nullable({"type": "boolean", "description": "end-of-turn tokens do not end the reply"}),
    "reasoning_effort": nullable(STRING),
    "thinking_level": nullable(STRING),
    "reasoning": nullable(obj([], {"effort": nullable(STRING)})),
    "enable_thinking": nullable(BOOLEAN),
    "thinking": nullable({"anyOf": [BOOLEAN, obj(["type"], {"type": {"enum": ["enabled", "disabled"]}})]}),
    "chat_template_kwargs": nullable(obj([], {"enable_thinking": nullable(BOOLEAN),
                                              "reasoning_effort": nullable(STRING)})),
    "thinking_budget": nullable({"type": "integer", "minimum": 1,
                                 "description": "reply tokens of reasoning before LSE closes the block"}),
    # structured output: at most one of these four
    "response_format": nullable({"anyOf": [   # json_schema is read only when the type is json_schema
        obj([], {"type": nullable({"enum": ["text", "json_object"]})}),
        obj(["type", "json_schema"], {"type": {"const": "json_schema"}, "json_schema": obj([], {
            "name": nullable(STRING), "schema": nullable({"type": ["object", "boolean"]}),
            "strict": nullable(BOOLEAN)})})]}),
    "structured_outputs": nullable(exactly_one_of({
        "json": {"type": ["object", "boolean", "string"]}, "regex": STRING,
        "choice": {"type": "array", "minItems": 1, "items": STRING}, "grammar": STRING, "json_object": BOOLEAN},
        description="vLLM's: exactly one of json, regex, choice, grammar (Lark), json_object")),
    "grammar": nullable({"type": "string", "minLength": 1, "description": "llama.cpp's GBNF (or Lark)"}),
    "json_schema": nullable({"type": ["object", "boolean"], "description": "llama.cpp's: the reply's JSON Schema"}),
}
SAMPLING_FIELDS = {name: schema if "anyOf" in schema and {"type": "null"} in schema["anyOf"] else nullable(schema)
                   for name, schema in SAMPLING_FIELDS.items()}

TOOL = obj(["type", "function"], {"type": {"const": "function"}, "function": obj(["name"], {
    "name": STRING, "parameters": nullable({"type": "object"})})})
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]},
                          obj(["function"], {"type": nullable({"const": "function"}),
                                             "function": obj(["name"], {"name": STRING})})]}
# what makes each constraint field constrain the reply; at most one may (response_format text does not)
ACTIVE_CONSTRAINT = {
    "response_format": obj(["type"], {"type": {"enum": ["json_object", "json_schema"]}}),
    "structured_outputs": {"type": "object", "not": obj(["json_object"], {"json_object": {"const": False}})},
    "grammar": STRING, "json_schema": {"type": ["object", "boolean"]},
}
AT_MOST_ONE_CONSTRAINT = {"allOf": [
    {"not": obj([a, b], {a: ACTIVE_CONSTRAINT[a], b: ACTIVE_CONSTRAINT[b]})}
    for i, a in enumerate(ACTIVE_CONSTRAINT) for b in list(ACTIVE_CONSTRAINT)[i + 1:]]}
MESSAGE_CONTENT = {"anyOf": [STRING, {"type": "array", "items": obj(["type", "text"], {
    "type": {"const": "text"}, "text": STRING})}]}
TOOL_CALLS = {"type": "array", "items": obj(["function"], {"function": obj(["name"], {"name": STRING})})}
NAME = {"name": nullable(STRING)}
MESSAGE = {"anyOf": [   # each role's fields (others are ignored); content may be null only on an assistant turn
    obj(["role", "content"], {"role": {"enum": ["system", "user", "developer"]}, "content": MESSAGE_CONTENT, **NAME}),
    obj(["role", "content"], {"role": {"const": "tool"}, "content": MESSAGE_CONTENT, **NAME,
                              "tool_call_id": nullable(STRING)}),
    obj(["role"], {"role": {"const": "assistant"}, "content": nullable(MESSAGE_CONTENT), **NAME,
                   "tool_calls": nullable(TOOL_CALLS), "reasoning_content": nullable(STRING)})]}

CLOSING = {   # what a whole response and a stream's final chunk carry
    "lse_context": ref("LSEContext"),
    "timings": ref("Timings"),
    "lse_warnings": {"type": "array", "items": ref("LSEWarning")},
}

CHAT_MESSAGE = obj(["role", "content"], {
    "role": {"const": "assistant"}, "content": nullable(STRING), "reasoning_content": STRING,
    "tool_calls": {"type": "array", "items": {"type": "object"}}})
CHAT_DELTA = obj([], {"role": {"const": "assistant"}, "content": STRING, "reasoning_content": STRING,
                      "tool_calls": {"type": "array", "items": {"type": "object"}}})
LOGPROBS = nullable({"type": "object"})


def completion_object(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return obj(["id", "object", "created", "model", "choices", "usage", "lse_context", "timings"], {
        "id": STRING, "object": {"const": kind}, "created": INTEGER, "model": STRING,
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": choice},
        "usage": ref("Usage"), **CLOSING})


def chunk_object(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    """A streamed chunk: a delta (stop_reason null), the final chunk (finish/stop_reason, lse_context,
    timings) or the usage chunk (choices empty)."""
    return obj(["id", "object", "created", "model", "choices"], {
        "id": STRING, "object": {"const": kind}, "created": INTEGER, "model": STRING,
        "choices": {"type": "array", "maxItems": 1, "items": choice},
        "usage": nullable(ref("Usage")), **CLOSING})


def choice(required: list[str], content: dict[str, Any], stop_reason: dict[str, Any]) -> dict[str, Any]:
    return obj(["index", *required, "finish_reason", "stop_reason", "logprobs"],
               {"index": {"const": 0}, **content, "finish_reason": FINISH_REASON, "stop_reason": stop_reason,
                "logprobs": LOGPROBS})


SCHEMAS: dict[str, Any] = {
    "Error": obj(["error"], {"error": obj(["message", "type", "code", "param"], {
        "message": STRING, "type": STRING, "code": nullable(STRING), "param": nullable(STRING),
        "levels": {"type": "array", "items": STRING, "description": "thinking errors: the model's level ids"},
        "lse_context": ref("LSEContext"),
    })}),
    "ChatCompletionRequest": obj(["messages"], {"messages": {"type": "array", "minItems": 1, "items": MESSAGE},
                                                "logprobs": nullable(BOOLEAN),
                                                "top_logprobs": nullable({"type": "integer", "minimum": 0,
                                                                          "maximum": 20}),
                                                "tools": nullable({"type": "array", "items": TOOL}),
                                                "tool_choice": nullable(TOOL_CHOICE),
                                                "parallel_tool_calls": nullable(BOOLEAN),
                                                **SAMPLING_FIELDS}, **AT_MOST_ONE_CONSTRAINT),
    "CompletionRequest": obj(["prompt"], {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS,
                             {"type": "array", "minItems": 1, "maxItems": 1,
                              "items": {"anyOf": [{"type": "string", "minLength": 1}, TOKEN_IDS]}}]},
        "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 5}),
        "echo": nullable(BOOLEAN), **SAMPLING_FIELDS}, **AT_MOST_ONE_CONSTRAINT),
    "ChatCompletion": completion_object("chat.completion", choice(["message"], {"message": CHAT_MESSAGE},
                                                                  STOP_REASON)),
    "ChatCompletionChunk": chunk_object("chat.completion.chunk", choice(["delta"], {"delta": CHAT_DELTA},
                                                                        nullable(STOP_REASON))),
    "TextCompletion": completion_object("text_completion", choice(["text"], {
        "text": STRING, "reasoning_content": STRING}, STOP_REASON)),
    "TextCompletionChunk": chunk_object("text_completion", choice(["text"], {
        "text": STRING, "reasoning_content": STRING}, nullable(STOP_REASON))),
    "Usage": obj(["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                  "completion_tokens_details"], {
        "prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
        "prompt_tokens_details": obj(["cached_tokens"], {"cached_tokens": COUNT}),
        "completion_tokens_details": obj(["reasoning_tokens"], {"reasoning_tokens": COUNT},
                                         description="of the completion tokens, those inside the reasoning block")}),
    "LSEContext": obj(["tokens_used", "context_length", "tokens_remaining"], {
        "tokens_used": COUNT, "context_length": COUNT, "tokens_remaining": COUNT}),
    "Timings": obj(["prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                    "predicted_per_second"], {
        "prompt_n": COUNT, "prompt_ms": NUMBER, "prompt_per_second": NUMBER,
        "predicted_n": COUNT, "predicted_ms": NUMBER, "predicted_per_second": NUMBER}),
    "LSEWarning": obj(["type", "cause"], {"type": {"enum": ["cpu_fallback", "structured_output_incomplete"]},
                                          "cause": STRING, "count": COUNT},
                      description="count: a cpu_fallback's runs in this request"),
    "Thinking": obj(["supported", "source", "toggle", "effort", "default_level", "levels"], {
        "supported": BOOLEAN, "source": nullable(STRING), "toggle": nullable({"const": "enable_thinking"}),
        "effort": nullable({"const": "reasoning_effort"}), "default_level": nullable(STRING),
        "levels": {"type": "array", "items": obj(
            ["id", "enable_thinking", "reasoning_effort", "instruction", "opens_reasoning", "default"], {
                "id": STRING, "enable_thinking": nullable(BOOLEAN), "reasoning_effort": nullable(STRING),
                "instruction": nullable(STRING), "opens_reasoning": BOOLEAN, "default": BOOLEAN})}}),
    "GenerationDefaults": obj(["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                               "max_new_tokens", "max_length", "sources"], {
        "temperature": NUMBER, "top_k": INTEGER, "top_p": NUMBER, "min_p": NUMBER,
        "repetition_penalty": NUMBER, "presence_penalty": NUMBER,
        "max_new_tokens": nullable(INTEGER), "max_length": nullable(INTEGER),
        "sources": {"type": "object", "additionalProperties": {
            "enum": ["generation_config.json", "config.json", "server_option", "lse_default"]}}}),
    "Model": obj(["id", "object", "created", "owned_by", "context_length", "thinking", "generation_defaults",
                  "structured_outputs"], {
        "id": STRING, "object": {"const": "model"}, "created": INTEGER, "owned_by": STRING,
        "context_length": COUNT, "thinking": ref("Thinking"), "generation_defaults": ref("GenerationDefaults"),
        "structured_outputs": obj(["supported", "engine", "kinds", "fields", "tool_choice"], {
            "supported": BOOLEAN, "engine": STRING, "kinds": {"type": "array", "items": STRING},
            "fields": {"type": "array", "items": STRING}, "tool_choice": {"type": "array", "items": STRING}})}),
    "ModelList": obj(["object", "data"], {"object": {"const": "list"}, "data": {"type": "array",
                                                                               "items": ref("Model")}}),
    "Device": obj(["name", "kind", "codegen", "description"], {
        "name": STRING, "kind": {"enum": ["gpu", "cpu", "accelerator"]}, "codegen": BOOLEAN,
        "description": STRING}),
    "ModelInfo": obj(["object", "id", "source", "architecture", "context_length", "thinking",
                      "generation_defaults", "devices", "plan", "served"], {
        "object": {"const": "lse.model_info"}, "id": STRING, "source": STRING, "architecture": STRING,
        "context_length": COUNT, "trained_context_length": COUNT, "vocab_size": COUNT,
        "thinking": ref("Thinking"), "generation_defaults": ref("GenerationDefaults"),
        "devices": {"type": "array", "items": ref("Device")},
        "plan": obj(["groups", "cpu_fallback_groups"], {"groups": COUNT, "cpu_fallback_groups": {
            "type": "array", "items": STRING}}),
        "served": ref("Model")}),
    "Status": obj(["object", "model", "context_length", "devices", "placements", "kv_cache", "engine", "stats"], {
        "object": {"const": "lse.status"}, "model": STRING, "context_length": COUNT,
        "devices": {"type": "array", "items": ref("Device")},
        "placements": {"type": "array", "items": obj(["group", "layer", "ops", "device", "cpu_fallback"], {
            "group": COUNT, "layer": INTEGER, "ops": {"type": "array", "items": STRING},
            "device": nullable(STRING), "cpu_fallback": nullable(STRING)},
            description="each fused group of the plan and the device that runs it (null: refused)")},
        "declined": {"type": "array", "items": STRING}, "startup_warnings": {"type": "array", "items": STRING},
        "kv_cache": obj(["type_k", "type_v", "devices"], {
            "type_k": ref("KVCacheType"), "type_v": ref("KVCacheType"),
            "devices": {"type": "array", "items": obj(["name", "type_k", "type_v"], {
                "name": STRING, "type_k": ref("KVCacheType"), "type_v": ref("KVCacheType")})}},
            description="the KV cache types asked for (--cache-type-k/-v), and what each device holding a cache "
                        "stores: f32 where it lacks the default f16 (a startup warning says so)"),
        "engine": obj(["steps", "running", "waiting", "paused", "slots", "free_slots", "cpu_fallback"], {
            "steps": COUNT, "running": COUNT, "waiting": COUNT, "paused": COUNT, "slots": COUNT, "free_slots": COUNT,
            "cpu_fallback": ref("CPUFallback")}),
        "stats": obj(["requests", "prompt_tokens", "cached_tokens", "completion_tokens"], {
            "uptime_s": NUMBER,
            "requests": {"type": "array", "items": obj(["endpoint", "outcome", "count"], {
                "endpoint": STRING, "outcome": STRING, "count": COUNT})},
            "prompt_tokens": COUNT, "cached_tokens": COUNT, "completion_tokens": COUNT})}),
    "KVCacheType": {"enum": list(KV_CACHE_TYPES)},
    "CPUFallback": obj(["allowed", "total", "events"], {
        "allowed": BOOLEAN, "total": COUNT,
        "events": {"type": "array", "items": obj(["cause", "count"], {"cause": STRING, "count": COUNT})}}),
    "Health": obj(["status"], {"status": {"enum": ["ok", "loading"]}}),
    "TokenizeRequest": {"anyOf": [
        obj(["content"], {"content": STRING}, description="llama.cpp's: plain text"),
        ref("CompletionRequest"), ref("ChatCompletionRequest")],
        "properties": {name: nullable(BOOLEAN) for name in ("add_special", "add_special_tokens",
                                                            "add_generation_prompt", "with_pieces")},
        "description": "a completion's or chat's body gives the tokens that request would start from"},
    "Tokenized": obj(["tokens", "count", "max_model_len"], {
        "tokens": {"type": "array", "items": {"anyOf": [COUNT, obj(["id", "piece"], {
            "id": COUNT, "piece": {"anyOf": [STRING, {"type": "array", "items": COUNT}]}})]}},
        "count": COUNT, "max_model_len": COUNT}),
    "Tokens": obj(["tokens"], {"tokens": {"type": "array", "items": TOKEN_ID}}),
    "Content": obj(["content"], {"content": STRING}),
}

# ---- the other APIs' replies (their requests are the adapters' pydantic models) ----

def text_part(kind: str, **more: Any) -> dict[str, Any]:
    return obj(["type", "text"], {"type": {"const": kind}, "text": STRING, **more})


RESPONSE_ITEM = {"anyOf": [
    obj(["type", "id", "role", "status", "content"], {
        "type": {"const": "message"}, "id": STRING, "role": {"const": "assistant"}, "status": STRING,
        "content": {"type": "array", "items": text_part("output_text", annotations={"type": "array"})}}),
    obj(["type", "id", "summary", "content"], {
        "type": {"const": "reasoning"}, "id": STRING, "summary": {"type": "array"},
        "content": {"type": "array", "items": text_part("reasoning_text")}}),
    obj(["type", "id", "call_id", "name", "arguments", "status"], {
        "type": {"const": "function_call"}, "id": STRING, "call_id": STRING, "name": STRING, "arguments": STRING,
        "status": STRING})]}
CONTENT_BLOCK = {"anyOf": [
    text_part("text"),
    obj(["type", "thinking", "signature"], {"type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}),
    obj(["type", "id", "name", "input"], {"type": {"const": "tool_use"}, "id": STRING, "name": STRING,
                                          "input": {"type": "object"}})]}
ANTHROPIC_USAGE = obj(["input_tokens", "output_tokens"], {
    "input_tokens": COUNT, "output_tokens": COUNT, "cache_read_input_tokens": COUNT,
    "cache_creation_input_tokens": COUNT})

REPLY_SCHEMAS: dict[str, Any] = {
    "Response": obj(["id", "object", "created_at", "status", "model", "output", "usage"], {
        "id": STRING, "object": {"const": "response"}, "created_at": INTEGER,
        "status": {"enum": ["completed", "incomplete", "cancelled", "in_progress"]},
        "incomplete_details": nullable(obj(["reason"], {"reason": {"const": "max_output_tokens"}})),
        "model": STRING, "output": {"type": "array", "items": RESPONSE_ITEM},
        "previous_response_id": nullable(STRING),
        "usage": nullable(obj(["input_tokens", "input_tokens_details", "output_tokens", "total_tokens"], {
            "input_tokens": COUNT, "input_tokens_details": obj(["cached_tokens"], {"cached_tokens": COUNT}),
            "output_tokens": COUNT, "output_tokens_details": obj(["reasoning_tokens"], {"reasoning_tokens": COUNT}),
            "total_tokens": COUNT})),
        "stop_reason": STOP_REASON, **CLOSING}),
    "ResponseStreamEvent": obj(["type", "sequence_number"], {"type": STRING, "sequence_number": COUNT},
                               description="response.created ... response.completed, as the openai SDK reads them"),
    "Message": obj(["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"], {
        "id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STRING,
        "content": {"type": "array", "items": CONTENT_BLOCK},
        "stop_reason": nullable({"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use",
                                          "model_context_window_exceeded"]}),
        "stop_sequence": nullable(STRING), "usage": ANTHROPIC_USAGE, "lse_stop_reason": STOP_REASON, **CLOSING}),
    "MessageStreamEvent": obj(["type"], {"type": {"enum": [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop", "error"]}}),
    "AnthropicError": obj(["type", "error"], {"type": {"const": "error"}, "error": obj(
        ["type", "message", "code", "param"], {
            "type": {"enum": ["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                              "request_too_large", "rate_limit_error", "overloaded_error", "api_error"]},
            "message": STRING, "code": nullable(STRING), "param": nullable(STRING),
            "levels": {"type": "array", "items": STRING}, "lse_context": ref("LSEContext")})}),
    "TokenCount": obj(["input_tokens"], {"input_tokens": COUNT}),
    "EmbeddingList": obj(["object", "data", "model", "usage"], {
        "object": {"const": "list"}, "model": STRING,
        "data": {"type": "array", "items": obj(["object", "index", "embedding"], {
            "object": {"const": "embedding"}, "index": COUNT,
            "embedding": {"anyOf": [{"type": "array", "items": NUMBER},
                                    {"type": "string", "description": "base64 of little-endian float32"}]}})},
        "usage": obj(["prompt_tokens", "total_tokens"], {"prompt_tokens": COUNT, "total_tokens": COUNT}),
        "lse_warnings": {"type": "array", "items": ref("LSEWarning")}}),
}


def request_schemas() -> dict[str, Any]:
    """The adapters' and embeddings' request bodies as their pydantic models declare them."""
    models = (ResponsesRequest, MessagesRequest, CountTokensRequest, EmbeddingsRequest)
    _, schema = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return schema["$defs"]


def _merged(*parts: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        if set(part) & set(merged):
            raise RuntimeError(f"OpenAPI schema names declared twice: {sorted(set(part) & set(merged))}")
        merged |= part
    return merged


ERROR_TEXT = {400: "invalid request (invalid_json, invalid_type, invalid_value, missing_field, context_full, "
                   "thinking errors...)",
              401: "missing or wrong API key (authentication_error, invalid_api_key)",
              403: "bound to loopback, the Host header names another host (host_not_allowed)",
              404: "no such route or model", 413: "request body over 8 MiB",
              415: "the body is not sent as Content-Type: application/json (unsupported_media_type)",
              500: "server_error: an engine failure, or CPU fallback disabled: <group>",
              503: "the model is loading, or the request queue is full"}


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


def typed_stream_path(summary: str, request: str, response: str, event: str,
                      errors: dict[str, Any] = ERRORS) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": f"a {response}, or with stream: true server-sent events `event: <type>` and "
                                   f"`data: <{event}>` (an error after streaming began is an error event)",
                    "content": {"application/json": {"schema": ref(response)},
                                "text/event-stream": sse(ref(event))}},
            **errors}}}


ANTHROPIC_ERRORS = {str(status): json_body(ref("AnthropicError"), text) for status, text in ERROR_TEXT.items()}


GET_ERRORS = (401, 403, 500, 503)   # what any GET may answer besides 200 (a key, the Host, loading)


def get(summary: str, schema: str, *errors: int, media: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": summary, "content": {media: {"schema": ref(schema) if schema else STRING}}},
        **{str(s): ERRORS[str(s)] for s in sorted({*GET_ERRORS, *errors})}}}}


def post(summary: str, request: str, response: str, errors: dict[str, Any] = ERRORS) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
                     "responses": {"200": json_body(ref(response), summary), **errors}}}


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "LSE", "version": "0.1.0",
             "description": "LSE's OpenAI-compatible API, with LSE's own fields (stop_reason, lse_context, "
                            "timings, lse_warnings, thinking levels, generation defaults)."},
    "components": {
        "schemas": _merged(SCHEMAS, REPLY_SCHEMAS, request_schemas()),
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
                                           "ResponseStreamEvent"),
        "/v1/responses/{response_id}": {
            **get("A stored response (made with store, among the last 256)", "Response", 404),
            "delete": {"summary": "Forget a stored response", "responses": {
                "200": json_body(obj(["id", "object", "deleted"], {
                    "id": STRING, "object": {"const": "response.deleted"}, "deleted": {"const": True}}), "deleted"),
                **{str(s): ERRORS[str(s)] for s in (*GET_ERRORS, 404)}}},
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": STRING}]},
        "/v1/messages": typed_stream_path("Anthropic Messages (errors in Anthropic's shape)", "MessagesRequest",
                                          "Message", "MessageStreamEvent", ANTHROPIC_ERRORS),
        "/v1/messages/count_tokens": post("The prompt tokens of a Messages conversation", "CountTokensRequest",
                                          "TokenCount", ANTHROPIC_ERRORS),
        "/v1/embeddings": post("Pooled, L2-normalized final hidden states of each input", "EmbeddingsRequest",
                               "EmbeddingList"),
        "/v1/models": get("The served model", "ModelList", 503),
        "/v1/models/{model_id}": {**get("One model", "Model", 404, 503),
                                  "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                  "schema": STRING}]},
        "/v1/lse/model_info": get("lse_model_info", "ModelInfo", 503),
        "/v1/lse/status": get("lse_status", "Status", 503),
        "/health": {"get": {"summary": "200 when the model is loaded, 503 while it loads", "security": [],
                            "responses": {"200": json_body(ref("Health"), "ready"),
                                          "503": json_body(ref("Health"), "loading")}}},
        "/": {"get": {"summary": "The chat page (its files under /page/), served without the API key",
                      "security": [], "responses": {"200": {"description": "the page",
                                                            "content": {"text/html": {"schema": STRING}}}}}},
        "/tokenize": post("Tokens of text, or of a completion's or chat's prompt", "TokenizeRequest", "Tokenized"),
        "/detokenize": post("Text of token ids", "Tokens", "Content"),
        "/metrics": get("Prometheus metrics", "", 503, media="text/plain"),
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": json_body({"type": "object"},
                                                                                            "OpenAPI 3.1")}}},
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
